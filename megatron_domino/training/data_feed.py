"""The trainer's micro-batches: the datasets of ``cfg.data`` (and ``eval.path``'s sets), read on the ranks that need
tokens or labels."""
from __future__ import annotations

from ..data import MicroBatchLoader, build_train_valid_test_datasets
from ..data.builder import build_eval_sets
from ..data.attention_balance import AttentionBalancer
from ..models.mtp import with_mtp_targets
from ..models.ring_attention import split_for_context_parallel
from ..parallel.store_barrier import Phase


class DataFeed:
    """Train and validation loaders for this rank (none on a middle stage, whose activations arrive over p2p),
    with multi-token prediction's shifted targets made and context parallelism's split applied; ``consumed``
    counts the training samples read so far (a checkpoint keeps it)."""

    def __init__(self, cfg, state, engine, watchdog):
        train, data = cfg.train, cfg.data
        self.state, self.num_microbatches = state, engine.num_microbatches
        self.mtp_depth = cfg.model.mtp_num_layers if engine.holds_loss else 0  # MTP's shifts, on whole samples
        self.global_batch_size, self.consumed = train.global_batch_size, 0
        eval_samples = train.eval_iters * train.global_batch_size
        evaluations = (train.steps // train.eval_interval + 1) if train.eval_interval else 1
        phase = Phase("index build", data.index_build_timeout_s, "data.index_build_timeout_s", state.barriers)
        with watchdog.watching(phase):
            train_ds, valid_ds, _ = build_train_valid_test_datasets(
                cfg, (train.steps * train.global_batch_size, evaluations * eval_samples, 0),
                build_on_this_rank=state.rank == 0, barrier=lambda: phase.barrier("indices cached"))
            eval_sets = build_eval_sets(cfg, eval_samples, build_on_this_rank=state.rank == 0,
                                        barrier=lambda: phase.barrier("evaluation sets' indices cached"))
        reads = engine.needs_tokens or engine.holds_loss or data.reset_position_ids or data.reset_attention_mask
        par = cfg.parallel
        self.balancer = (AttentionBalancer(train.micro_batch_size, data.balance_tolerance, par.cp, par.cp_comm,
                                           par.cp_a2a_size or 1) if data.balance_attention and reads else None)
        make = lambda ds, arrange=None: (MicroBatchLoader(ds, train.global_batch_size,  # noqa: E731
                                                          train.micro_batch_size, state.dp_rank, state.dp_size,
                                                          arrange=arrange)
                                         if ds is not None and reads else None)
        self.train_loader, self.valid_loader = make(train_ds, self.balancer), make(valid_ds)
        self.has_validation = valid_ds is not None
        self.eval_sets = {name: make(ds) for name, ds in eval_sets}  # name -> loader (None where nothing is read)

    def resume(self, consumed_samples: int) -> None:
        self.consumed = consumed_samples
        if self.train_loader is not None:
            self.train_loader.load_state_dict({"consumed_samples": consumed_samples})

    def next_train_step(self) -> list[dict]:
        return self._next(self.train_loader)

    def count_step(self) -> None:
        """The step trained on what ``next_train_step`` gave (a step the guard stopped is not counted, so a
        resume reads its samples again)."""
        self.consumed += self.global_batch_size

    def step_documents(self, limit: int = 16) -> str:
        """What the next step trains on: its global sample range and, where this rank reads the data, the
        documents of those samples (the first ``limit``), for the bad-step report."""
        first = self.consumed
        text = f"samples {first}..{first + self.global_batch_size - 1} of the training set"
        dataset = self.train_loader.dataset if self.train_loader is not None else None
        if dataset is None or not hasattr(dataset, "documents"):
            return text
        size = len(dataset)
        names = [name for i in range(first, first + self.global_batch_size) for name in dataset.documents(i % size)]
        names = list(dict.fromkeys(names))
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        return f"{text}, documents {', '.join(names[:limit])}{more}"

    def validation_steps(self, iters: int, eval_set: str | None = None):
        """``iters`` steps of validation micro-batches (of ``eval_set``'s, if named), from the start each time."""
        loader = self.eval_sets[eval_set] if eval_set is not None else self.valid_loader
        if loader is not None:
            loader.load_state_dict({"consumed_samples": 0})
        return (self._next(loader) for _ in range(iters))

    def _next(self, loader) -> list[dict]:
        if loader is None:  # a middle stage: activations come over p2p
            return [{} for _ in range(self.num_microbatches)]
        microbatches = loader.next_step()  # in host memory: the engine moves them to the device one at a time
        if self.mtp_depth:
            microbatches = [with_mtp_targets(b, self.mtp_depth) for b in microbatches]
        if self.state.cp_size > 1:  # this rank's two chunks of each sequence
            state = self.state
            return [split_for_context_parallel(b, state.cp_size, state.cp_rank, state.topology.cp_a2a)
                    for b in microbatches]
        return microbatches
