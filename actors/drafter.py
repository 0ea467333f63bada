"""Drafter: a Ray actor on its own device, with its own paged KV, proposing draft tokens for the
sequences assigned to it. A thin shell over the core's proposers."""

from __future__ import annotations

import os

import torch


class Drafter:
    def __init__(self, cfg: dict, device: str = "cpu", threads: int = 1):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        torch.set_num_threads(threads)
        from dspark_cluster.config import load_config
        from dspark_cluster.model.spec import load_spec
        from dspark_cluster.proposers import make_proposer

        cfg = load_config(cfg)
        self.proposer = make_proposer(cfg, load_spec(cfg.model.path, cfg.model.dtype), device)

    def ready(self) -> bool:
        return True

    def propose(self, requests):
        return self.proposer.propose(requests)

    def prefill(self, requests) -> None:
        self.proposer.prefill(requests)

    def free(self, seq_ids) -> None:
        self.proposer.free(seq_ids)
