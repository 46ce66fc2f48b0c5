"""A training run from start to end, as the entry points call it once the config is loaded and validated: build the
trainer, train (or evaluate), report a failure with the rank's coordinates, end the process group."""
from __future__ import annotations

import os

from ..parallel.launch import shutdown_distributed
from .signals import EarlySignals
from .trainer import Trainer


def run(cfg, eval_only: bool = False, early: EarlySignals | None = None) -> None:
    trainer = Trainer(cfg, writes_checkpoints=not eval_only)
    try:
        if eval_only:
            trainer.evaluate()
        else:
            trainer.train(early)
    except BaseException as error:
        trainer.watchdog.report_failure(error)
        trainer.release_checkpoint_dir()
        raise
    if trainer.metrics.enabled:
        print(f"metrics: {trainer.metrics.jsonl_path}"
              + (f" | tensorboard: {os.path.join(cfg.log.dir, 'tensorboard')}" if cfg.log.tensorboard else ""),
              flush=True)
    trainer.close()
    shutdown_distributed()
