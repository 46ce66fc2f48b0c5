"""The data-parallel optimizer: gradient buffers, ZeRO-0/1/2, mixed precision, clipping, one step.

Per parameter, bf16 weights with fp32 Adam cost 2 (weight) + 4 (fp32 gradient) + 12 (fp32 master,
exp_avg, exp_avg_sq) = 18 bytes. ZeRO-1 shards the 12 over the d DP ranks (6 + 12/d, Megatron's
distributed optimizer); ZeRO-2 also keeps only a 1/d shard of the gradient (2 + 16/d), reducing every
micro-batch (``optim/grad_buffer.py``). ZeRO-0 keeps everything and all-reduces.

One step, on every rank:
  backward   ``begin_backward`` before each pass; hooks move each gradient into its bucket; on the last
             micro-batch (ZeRO-2: on every one) a full bucket starts its DP reduction at once
             (all-reduce, or reduce-scatter when sharded), overlapping the rest of backward;
  finish     wait for every bucket (the trainer may then all-reduce ``reduced_grad(p)`` over the
             embedding or TP group, in place);
  step       unscale (fp16) and look for inf/nan on every rank; skip everywhere together if found;
             global L2 norm (each element once), clip, update this rank's fp32 shard, cast it back
             into the weights and all-gather the weights over DP. With ``optimizer.offload`` a host thread
             steps the offloaded buckets behind the next forward (``host_step``).

fp32 weights are their own master: the shard's master tensor is a view of the weight, so no copy
is kept. The reduction is a SUM over DP: the trainer already divides the loss by the global count.

Experts under expert parallelism: an expert's replicas are the expert-data-parallel group's (dp * cp / ep
ranks), so expert parameters get buffers of their own, reduced and ZeRO-sharded over that group. The sum
is still the whole gradient: the all-to-all's backward already brought every rank's tokens' share home.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..config.errors import ConfigError
from ..config.schema import ZERO_STAGES, OptimizerConfig
from ..parallel import comm
from .grad_buffer import Fragment, GradBuffer
from .grad_norm import global_norm, local_squared_norm
from .loss_scaler import found_inf_across_ranks, loss_scaler_from_config
from .host_step import offload_step
from .low_precision import DTYPES, stream_key
from .muon import MuonStep
from .muon_plan import describe
from .param_groups import InnerSteps
from .qk_clip import QKClip
from .state_access import StateAccess
from .weight_hooks import shard_model_weights, sharded_weight, unit_keys


class DistributedOptimizer(StateAccess):
    """See the module docstring. ``norm_groups``: the model-parallel groups (TP, PP) over which squared
    norms and inf flags are summed besides DP; None entries are skipped. ``dp_group`` None means no data
    parallelism (only without torch.distributed, or with one rank). ``bucket_alone``: global names of
    parameters that get a bucket of their own, so their reduced-gradient regions match on every stage that
    holds a copy (the tied word embedding, summed over the first and last stage). ``expert_dp_group`` and
    ``ep_group``: where expert parameters are replicated and where they differ (None: no expert parallelism)."""

    @classmethod
    def for_layout(cls, model_chunks: list[torch.nn.Module], opt: OptimizerConfig, state, *, fp16: bool = False,
                   bf16: bool = False, bucket_alone: tuple[str, ...] = ()) -> "DistributedOptimizer":
        """The optimizer of ``state``'s layout (a ``ParallelState``): gradients reduced over dp x cp, experts'
        over their own replicas, the norm over TP and the pipeline."""
        return cls(model_chunks, opt, dp_group=state.dp_cp_group, tp_rank=state.tp_rank,
                   norm_groups=[state.tp_group, state.pp_group], fp16=fp16, bf16=bf16, bucket_alone=bucket_alone,
                   expert_dp_group=state.expert_dp_group, ep_group=state.ep_group, tp_group=state.tp_group)

    def __init__(self, model_chunks: list[torch.nn.Module], opt: OptimizerConfig, *, dp_group, tp_rank: int,
                 norm_groups: list, fp16: bool = False, bf16: bool = False, bucket_alone: tuple[str, ...] = (),
                 expert_dp_group=None, ep_group=None, tp_group=None):
        if fp16 and bf16:
            raise ConfigError("train.fp16 / train.bf16", (fp16, bf16), "at most one precision may be chosen",
                              "set one of them to false")
        if opt.zero_stage not in ZERO_STAGES:
            raise ConfigError("optimizer.zero_stage", opt.zero_stage, f"must be one of {ZERO_STAGES}",
                              "use 1 (sharded optimizer state) or 0 (plain all-reduce)")
        self.opt, self.dp_group, self.tp_rank = opt, dp_group, tp_rank
        self.ep_group = ep_group if comm.group_size(ep_group) > 1 else None
        self.expert_dp_group = expert_dp_group if self.ep_group is not None else dp_group
        self.norm_groups = [group for group in norm_groups if group is not None]
        dp = comm.group_size(dp_group)
        self.zero_stage = opt.zero_stage if dp > 1 else 0  # one DP rank: a shard is the whole
        self.dp_rank = comm.group_rank(dp_group)
        self.fp16, self.scaler = fp16, loss_scaler_from_config(opt, fp16)
        self.names = {id(p): name for chunk in model_chunks for name, p in chunk.named_global_parameters()}
        self.infos = {id(p): table[name] for chunk, table in ((c, c.sharding()) for c in model_chunks)
                      for name, p in chunk.named_global_parameters()}  # sharding-table rows, for the norm
        self.bucket_alone = bucket_alone
        units = unit_keys(model_chunks) if self.zero_stage == 3 else {}  # id(weight) -> its ZeRO-3 unit
        self.buffers = self._build_buffers(model_chunks, units)
        self.units = shard_model_weights(model_chunks, self.buffers, units, opt) if units else None
        self.fragments: list[Fragment] = [f for buffer in self.buffers for f in buffer.fragments()]
        self.device = self.buffers[0].device if self.buffers else torch.device("cpu")
        self.muon = self._muon(tp_group) if opt.name == "muon" else None
        scales = {i: self.muon.scale_of(i) for i in range(len(self.fragments))} if self.muon is not None else {}
        keys = [stream_key(self.infos[id(f.param)].tied_to or self.names[id(f.param)], f.start) for f in self.fragments]
        self.host = offload_step(model_chunks, self.buffers, self.fragments, opt, self.device, self.units, scales, keys)
        dtype = DTYPES[opt.master_dtype]
        self.masters = [self.host.masters[i] if i in self.host.masters  # offloaded: a host copy
                        else f.data if f.data.dtype == dtype else f.data.to(dtype)  # weights of its dtype: themselves
                        for i, f in enumerate(self.fragments)]
        on_device = [(m, f.param, scales.get(i), keys[i]) for i, (m, f) in enumerate(zip(self.masters, self.fragments))
                     if i not in self.host.masters]
        self.optimizer = InnerSteps(on_device, opt) if on_device else None  # the device's masters
        self._fragment_of = {id(f.param): f for f in self.fragments}
        self._buffer_of = {id(p): buffer for buffer in self.buffers for p in buffer.params}
        for buffer in self.buffers:
            for param in buffer.params:
                param.register_post_accumulate_grad_hook(self._on_grad)
        self._last_microbatch = True
        self.steps = 0
        self.qk_clip: QKClip | None = None

    def _build_buffers(self, model_chunks, units: dict[int, str]) -> list[GradBuffer]:
        """One buffer per (chunk, weight dtype, expert or not, weights sharded or not), parameters in reverse
        registration (~ backward) order."""
        buffers = []
        for chunk in model_chunks:
            by_kind: dict[tuple[torch.dtype, bool, bool], list] = {}
            for param in chunk.parameters():
                if param.requires_grad:
                    sharded = self.zero_stage == 3 and sharded_weight(param)  # ZeRO-3 keeps vectors whole
                    by_kind.setdefault((param.dtype, self.infos[id(param)].expert, sharded), []).append(param)
            for (dtype, expert, sharded), params in by_kind.items():
                grad_dtype = torch.float32 if self.opt.accumulate_grads_in_fp32 else dtype
                bucket_elems = max(1, int(self.opt.bucket_size_mb * 2**20) // grad_dtype.itemsize)
                group = self.expert_dp_group if expert else self.dp_group
                buffers.append(GradBuffer(params[::-1], grad_dtype, bucket_elems, group,
                                          shard=self.zero_stage >= 1, release=self.zero_stage >= 2,
                                          alone=lambda p: self.names.get(id(p)) in self.bucket_alone,
                                          shard_weights=sharded, unit_of=lambda p: units.get(id(p))))
        return buffers

    def _muon(self, tp_group) -> MuonStep:
        """Muon's plan over every 2-D hidden weight this rank's buffers hold (the rest is AdamW's)."""
        tp = comm.group_size(tp_group)
        entries = [(describe(p, self.infos[id(p)], buffer, tp, self.opt), buffer.group) for buffer in self.buffers
                   for p in buffer.params if self.infos[id(p)].matrix and p.dim() == 2]
        return MuonStep(entries, self.fragments, self.opt, tp_group, self.device)

    # ----- the step's brackets ---------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def skipped_steps(self) -> int:
        return self.scaler.skipped_steps

    @property
    def reductions_launched(self) -> int:
        """Bucket reductions launched since construction (tests count them)."""
        return sum(buffer.launches for buffer in self.buffers)

    def clip_logits(self, trackers: list) -> None:
        """MuonClip (``optim/qk_clip.py``) over the attention layers' logit ``trackers`` (``models.logit_max``)."""
        if self.host.masters:
            raise ConfigError("optimizer.muon_qk_clip", self.opt.muon_qk_clip, "rescales masters on the device, and "
                              "optimizer.offload keeps them on the host", "set optimizer.offload=null")
        self.qk_clip = QKClip(trackers, self.fragments, self.opt.muon_qk_clip, self.dp_group)

    def zero_grad(self) -> None:
        if self.qk_clip is not None:  # a step begins: its logits alone count
            self.qk_clip.reset()
        for buffer in self.buffers:
            buffer.zero()
            for param in buffer.params:
                param.grad = None

    def begin_backward(self, is_last: bool) -> None:
        """Called before every backward pass (B, I or W): ``is_last``, whether it belongs to the step's last
        micro-batch, when ZeRO-0/1 reduce."""
        self._last_microbatch = bool(is_last)
        for buffer in self.buffers:
            buffer.begin_pass()

    def _on_grad(self, param: torch.Tensor) -> None:
        self._buffer_of[id(param)].accumulate(param, self._last_microbatch, self.opt.overlap_grad_reduce)

    def finish_grad_sync(self) -> None:
        for buffer in self.buffers:
            buffer.launch_remaining()
        for buffer in self.buffers:
            buffer.wait()

    def reduced_grad(self, param: torch.Tensor) -> torch.Tensor:
        """1-D view of the DP-reduced gradient of the part of ``param`` this rank steps (all of it under
        ZeRO-0; possibly empty under ZeRO-1/2). Ranks with the same parameters get matching regions, so
        it can be all-reduced in place over the TP or embedding group between finish_grad_sync and step."""
        fragment = self._fragment_of.get(id(param))
        return fragment.grad if fragment is not None else self._buffer_of[id(param)].buckets[0].reduced[:0]

    # ----- the update ------------------------------------------------------------------------------
    def step(self, lr: float, accept=None) -> tuple[bool, torch.Tensor | None]:
        """Clip and update; returns (stepped, grad norm as a 0-dim device tensor, read it only to log).

        Only fp16 waits for the device here: skipping an overflowed step needs the flag on the host.
        Clipping multiplies by min(1, clip / norm) on the device. ``accept(norm, local_squared)``, when
        given, sees the global norm and this rank's share of it before anything changes; False drops
        the update (the trainer's bad-step guard; it must answer alike on every rank).
        """
        self.host.settle()  # the previous step's host update, where no forward read it
        if self.units is not None:  # backward is over and the weights are about to change
            self.units.release_all()
        reduced = [piece for buffer in self.buffers for piece in buffer.reduced()]
        if self.fp16:
            found_inf = self._found_inf(reduced)
            self.scaler.update(found_inf)
            if found_inf:
                return False, None
        local_squared = self._local_squared_norm()
        norm = global_norm(local_squared, ([self.dp_group] if self.zero_stage > 0 else []) + self.norm_groups)
        if accept is not None and not accept(norm, local_squared):
            return False, norm
        if self.opt.clip_grad > 0:
            torch._foreach_mul_(reduced, (self.opt.clip_grad / (norm + 1e-6)).clamp(max=1.0))
        self._update(lr)
        deferred = set(self.host.position)  # buckets the host thread is stepping
        for buffer in self.buffers:
            buffer.after_step(deferred)
        self.steps += 1
        return True, norm

    def _found_inf(self, reduced: list[torch.Tensor]) -> bool:
        """Unscale in place and check over DP, then over the model-parallel groups (a sum of flags > 0)."""
        found = found_inf_across_ranks(reduced, self.dp_group, self.scaler.inv_scale)
        if self.norm_groups:
            flag = torch.tensor(float(found), device=self.device)
            found = bool(global_norm(flag, self.norm_groups).item() > 0)
        return found

    def _local_squared_norm(self) -> torch.Tensor:
        """This rank's share of the squared L2 norm; summed over TP x PP, and over DP only when the shards
        are disjoint (ZeRO-1/2), it gives the global norm. Without ZeRO, experts' squares are first summed
        over the expert-parallel group, whose ranks hold different experts (with ZeRO, DP covers it)."""
        counted = [f for f in self.fragments if self.infos[id(f.param)].counts_once(self.tp_rank)]
        dense = local_squared_norm([f.grad for f in counted if not self.infos[id(f.param)].expert], self.device)
        experts = local_squared_norm([f.grad for f in counted if self.infos[id(f.param)].expert], self.device)
        if self.ep_group is not None and self.zero_stage == 0:
            dist.all_reduce(experts, group=self.ep_group)
        return dense + experts

    def _update(self, lr: float) -> None:
        """Muon orthogonalizes first (collective); then the host thread takes the offloaded buckets and the
        device steps its own masters meanwhile."""
        updates = self.muon.orthogonalize() if self.muon is not None else {}
        if self.host.order:
            self.host.launch(lr, updates, self.steps + 1)
        if self.optimizer is None:
            return
        on_device = [(i, m, f) for i, (m, f) in enumerate(zip(self.masters, self.fragments))
                     if i not in self.host.masters]
        self.optimizer.step(lr, {id(m): updates[i] if i in updates  # gradients in fp32, or fp64 as they are
                                 else f.grad.to(torch.promote_types(f.grad.dtype, torch.float32))
                                 for i, m, f in on_device}, self.steps + 1)
        if self.qk_clip is not None:
            self.qk_clip.apply(self.masters, self.fragments)
        copies = [(f.data, m) for _, m, f in on_device if m is not f.data]
        if copies:
            torch._foreach_copy_([data for data, _ in copies], [master for _, master in copies])

    def settle(self) -> None:
        """Complete the offloaded host step now (before reading or writing weights or masters from outside)."""
        self.host.settle()

    @torch.no_grad()
    def weights_loaded(self) -> None:
        """The weights were loaded without optimizer state (a converted checkpoint): the masters start from
        them, and no gathered copy of the old ones survives."""
        self.host.settle()
        for master, fragment in zip(self.masters, self.fragments):
            if master is not fragment.data:
                master.copy_(fragment.data)
        if self.units is not None:
            self.units.release_all()

    def gathered_weights(self):
        """A context within which every weight is whole and up to date (ZeRO-3 gathers them all): collective over
        DP."""
        self.host.settle()
        return self.units.all_gathered() if self.units is not None else contextlib.nullcontext()
