"""The mutation catalogue: for each headline claim of the docs, the library broken the way the claim rules out, and
the tests that must fail under it (tests/test_mutations.py applies each to a copy of the repository and runs them).

A mutation is a source patch: ``old``, text that occurs exactly once in ``path``, becomes ``new``. Its tests are the
cheapest that kill it (pytest node ids, run with ``-x``). A new claim, or a test sharpened after a mutation survived,
adds an entry here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    claim: str  # the documented claim it breaks
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


def _m(name, claim, path, old, new, *tests) -> Mutation:
    return Mutation(name, claim, path, old, new, tests)


TP = "tests/test_tensor_parallel.py::test_tensor_parallel_matches_dense[2]"
P2P = "tests/test_p2p_rules.py"
SCHEDULES = "tests/test_pipeline_schedules.py"
TOOL = "tests/test_rehearsal.py::test_the_tool_writes_every_role_with_the_documented_fields"
SYNC_FREE = "tests/test_sync_free.py"
MTP_REFERENCE = "tests/test_mtp_reference.py"
RESUME = "tests/test_resume.py::test_a_resume_is_bitwise"

MUTATIONS = [
    # ----- layout parity against one process (docs/design/testing.md, docs/domino.md)
    _m("tp-forward-reduction-dropped", "TP equals one process", "megatron_domino/parallel/comm.py",
       "return _all_reduce(x.clone(), group)", "return x.clone()", TP),
    _m("tp-backward-reduction-dropped", "TP equals one process", "megatron_domino/parallel/comm.py",
       "return _all_reduce(grad, ctx.group), None", "return grad, None", TP),
    _m("domino-chunks-out-of-order", "Domino's mu-chunks equal the whole batch",
       "megatron_domino/domino/model_forward.py", "torch.cat(outputs, dim=0)", "torch.cat(outputs[::-1], dim=0)", TP),
    _m("sp-norm-grads-not-summed", "sequence parallelism equals one process",
       "megatron_domino/pipeline/finalize_grads.py", "    sum_partial_grads_over_tp(chunks, state.tp_group, grad_of)",
       "    pass",
       "tests/test_moe.py::test_tp_domino_sequence_parallel_and_pipeline_train_like_one_process"),
    _m("tied-embedding-grads-not-summed", "the pipeline equals one process",
       "megatron_domino/pipeline/finalize_grads.py", "    allreduce_tied_embedding_grads(chunks, state, grad_of)",
       "    pass",
       "tests/test_pipeline.py::test_pipeline_matches_single_process"),
    _m("vocab-padding-in-the-softmax", "vocabulary padding never changes the loss",
       "megatron_domino/tensor_parallel/cross_entropy.py", "        if end > vocab_size:", "        if False:", TP),
    _m("replicated-dropout-per-rank", "dropout on replicated activations is the same on every TP rank",
       "megatron_domino/models/block.py",
       "            if self.ctx.sequence_parallel:\n                with self.ctx.tp_stream():\n"
       "                    out = F.dropout(out, self.hidden_dropout)",
       "            if True:\n                with self.ctx.tp_stream():\n"
       "                    out = F.dropout(out, self.hidden_dropout)", TP),
    _m("residual-compiled-under-dropout", "compiled training draws eager's dropout masks",
       "megatron_domino/models/compiled.py", "        if block.hidden_dropout == 0:", "        if True:",
       "tests/test_compile.py::test_compiled_training_equals_eager_at_tp2_with_domino_and_compiles_once"),
    # ----- NCCL's rules on gloo (docs/design/nccl-rules.md)
    _m("transfers-one-at-a-time", "every schedule deadlock-free under NCCL's rules",
       "megatron_domino/pipeline/program.py", "program.append(TransferGroup(tuple(pending_sends + recvs)))",
       "program.extend(TransferGroup((t,)) for t in pending_sends + recvs)",
       f"{SCHEDULES}::test_simulator_finds_the_unbatched_deadlock_and_proves_the_grouped_schedules"),
    _m("group-waited-in-part", "a group completes as a whole", "megatron_domino/pipeline/p2p.py",
       "        for work in group.works:\n            try:", "        for work in group.works[:1]:\n            try:",
       f"{P2P}::test_a_group_completes_as_a_whole_as_on_nccl"),
    _m("strict-transport-one-work-per-op", "a group answers with ONE work, as NCCL does",
       "megatron_domino/pipeline/strict_transport.py", "return [CoalescedWork(super()._launch(transfers, buffers))]",
       "return super()._launch(transfers, buffers)",
       f"{P2P}::test_strict_transport_returns_one_work_per_group_as_nccl_does"),
    _m("strict-transport-order-unchecked", "the strict transport matches transfers by order",
       "megatron_domino/pipeline/strict_transport.py", "        if not torch.equal(theirs, mine):",
       "        if False:", f"{P2P}::test_strict_transport_carries_grouped_schedules_and_refuses_the_wrong_tensor"),
    # ----- collectives get device tensors only
    _m("host-copy-accepted", "a host copy handed to a collective fails on gloo as on NCCL",
       "megatron_domino/parallel/strict.py", "        if isinstance(tensor, HostCopy):", "        if False:",
       "tests/test_strict_collectives.py::test_host_copies_are_refused_by_collectives_and_device_tensors_pass"),
    _m("token-count-left-on-the-host", "the rehearsal checks the device of every collective's tensor",
       "megatron_domino/loss/objective.py", "count = to_device(torch.stack(counts).sum(), device)",
       "count = torch.stack(counts).sum()", TOOL),
    _m("rehearsal-device-check-dropped", "the rehearsal checks the device of every collective's tensor",
       "megatron_domino/rehearsal/dispatch.py", "            _check_devices(func, args)\n", "",
       f"{SYNC_FREE}::test_the_rehearsal_refuses_a_host_tensor_at_a_collective"),
    # ----- no host sync in a steady-state step
    _m("an-added-item", "no host sync in a steady-state step", "megatron_domino/optim/grad_norm.py",
       "    return total.sqrt()\n", "    total.item()\n    return total.sqrt()\n", TOOL),
    _m("an-added-cpu", "no host sync in a steady-state step", "megatron_domino/optim/grad_norm.py",
       "    return torch.stack([g.float().pow(2).sum() for g in grads]).sum()",
       "    grads[0].cpu()\n    return torch.stack([g.float().pow(2).sum() for g in grads]).sum()", TOOL),
    _m("router-bincount", "the router's counts without a host sync", "megatron_domino/models/router.py",
       "counts = flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))",
       "counts = torch.bincount(flat, minlength=num_experts)",
       f"{SYNC_FREE}::test_routing_under_capacity_reads_nothing"),
    _m("shape-header-built-on-the-device", "variable_seq_lengths sends without a host sync",
       "megatron_domino/pipeline/p2p.py",
       "        host = torch.tensor(values, dtype=torch.int64, pin_memory=self.device.type == \"cuda\")\n"
       "        return host.to(self.device, non_blocking=True)",
       "        header = torch.zeros(len(values), dtype=torch.int64, device=self.device)\n"
       "        header[:] = torch.tensor(values)\n        return header",
       f"{SYNC_FREE}::test_a_shape_header_is_sent_without_a_host_sync"),
    # ----- bitwise resume
    _m("tp-rng-stream-not-restored", "a resume is bitwise with dropout", "megatron_domino/parallel/random.py",
       "        self.set_states(state[\"tracker\"])", "        pass", f"{RESUME}[tp2-dp2-domino-zero2]"),
    _m("default-rng-not-restored", "a resume is bitwise with dropout", "megatron_domino/parallel/random.py",
       "        torch.set_rng_state(state[\"cpu\"])", "        pass", f"{RESUME}[pp2-dp2-interleaved-fp16]"),
    _m("loss-scaler-growth-not-restored", "a resume is bitwise under fp16's loss scaler",
       "megatron_domino/optim/loss_scaler.py",
       "        self.growth_tracker = int(_entry(state, \"growth_tracker\", name))", "        pass",
       f"{RESUME}[pp2-dp2-interleaved-fp16]"),
    # ----- ZeRO's bytes and checkpoint shards
    _m("masters-in-a-full-copy", "ZeRO-1/2 hold 12/d bytes of optimizer state per weight",
       "megatron_domino/optim/distributed_optimizer.py",
       "else f.data if f.data.dtype == dtype else f.data.to(dtype)",
       "else f.data if f.data.dtype == dtype else "
       "torch.cat([f.data.to(dtype), f.data.new_zeros(f.bucket.size, dtype=dtype)])[:f.end - f.start]",
       "tests/test_zero.py::test_data_parallel_matches_one_process[2]"),
    _m("zero3-weights-kept-whole", "ZeRO-3 holds 18/d bytes of model state per weight",
       "megatron_domino/optim/weight_store.py", "    def release(self, bucket) -> None:\n"
       "        self.full(bucket).untyped_storage().resize_(0)",
       "    def release(self, bucket) -> None:\n        pass",
       "tests/test_zero3.py::test_zero3_data_parallel_matches_one_process[2]"),
    _m("zero3-saves-a-copy", "a ZeRO-3 save writes only the rank's shard, gathering nothing",
       "megatron_domino/training/checkpoint.py",
       "regions(param, info, tp_rank, f.start, f.end, flat=f.data)",
       "regions(param, info, tp_rank, f.start, f.end, flat=f.data.clone())",
       "tests/test_zero3.py::test_zero3_data_parallel_matches_one_process[2]"),
    _m("unwritable-folder-found-late", "an unwritable checkpoint folder is refused before step 1",
       "megatron_domino/training/checkpoint_dir.py", "    except OSError as problem:",
       "    except ValueError as problem:",
       "tests/test_checkpoint_disk.py::test_a_read_only_checkpoint_dir_fails_before_step_1"),
    _m("free-space-unchecked", "a disk too small for one checkpoint warns or fails at start-up",
       "megatron_domino/training/checkpoint_dir.py", "    if free >= need:", "    if True:",
       "tests/test_checkpoint_disk.py::test_a_disk_too_small_for_one_checkpoint_warns_or_fails"),
    # ----- models against their definitions
    _m("yarn-ramp-edge", "DeepSeek-V3's logits equal transformers'", "megatron_domino/models/rope.py",
       "high = min(math.ceil(dimension_of(beta_slow)), dim - 1)",
       "high = min(math.ceil(dimension_of(beta_slow)) + 1, dim - 1)",
       "tests/test_mla.py::test_deepseek_v3_logits_match_transformers_and_round_trip_bit_exact"),
    _m("mtp-norms-swapped", "DeepSeek-V3's MTP module converts from the hub's layout",
       "megatron_domino/convert/deepseek_v3.py",
       '"embedding_norm.weight": "enorm.weight", "hidden_norm.weight": "hnorm.weight"',
       '"embedding_norm.weight": "hnorm.weight", "hidden_norm.weight": "enorm.weight"', MTP_REFERENCE),
    _m("mtp-inputs-swapped", "MTP is DeepSeek-V3's", "megatron_domino/models/mtp.py",
       "torch.cat([self.embedding_norm(embedded), self.hidden_norm(hidden)], dim=-1)",
       "torch.cat([self.hidden_norm(hidden), self.embedding_norm(embedded)], dim=-1)", MTP_REFERENCE),
    _m("llama3-rope-blend-edge", "Llama's logits equal transformers'", "megatron_domino/models/rope.py",
       "blended = (1 - smooth) * inv_freq / scaling_factor + smooth * inv_freq",
       "blended = smooth * inv_freq / scaling_factor + (1 - smooth) * inv_freq",
       "tests/test_models_hf.py::test_logits_match_transformers"),
    _m("expert-bias-moves-the-wrong-way", "aux-loss-free balancing moves the bias toward underused experts",
       "megatron_domino/models/expert_bias.py", "torch.sign(load.mean() - load)", "torch.sign(load - load.mean())",
       "tests/test_expert_bias.py::test_bias_update_equals_its_closed_form_on_4_ranks"),
    # ----- config errors before any process group
    _m("validated-after-the-group-starts", "bad configs are refused before any process group starts",
       "megatron_domino/training/cli.py",
       "for message in validate_config(cfg, world_size=world, check_paths=check_paths, device_type=device_type):",
       "for message in []:", "tests/test_cli.py::test_bad_configs_are_refused_before_any_process_group_starts"),
    # ----- the timed group's link model
    _m("latency-counted-twice", "a timed operation lasts latency + bytes / bandwidth",
       "megatron_domino/rehearsal/links.py",
       "return 1e-6 * (link.latency_us + steps(n) * link.hop_us)",
       "return 1e-6 * (2 * link.latency_us + steps(n) * link.hop_us)",
       "tests/test_timed_group.py::test_each_operation_completes_after_latency_steps_and_bytes_over_bandwidth"),
]
