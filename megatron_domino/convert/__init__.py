"""Conversion between Hugging Face checkpoints and native full-size state dicts.

hf_mapping: tensor names and layouts, group by group; hf_config: config.json <-> ModelConfig;
hf_io: streaming safetensors reading/writing and HF's sharded layout; native_io: the native
checkpoint directory offline; convert: the hf-to-native, native-to-hf and reshard commands.
"""
