"""One transformer implementation; GPT and Llama are configurations of it."""
from .block import TransformerBlock
from .init import initialize_weights
from .language_model import LanguageModel
from .full_state import full_state_dict, load_full_state_dict
