"""Calibrator: the drafter group's Ray actor that distils the DSpark drafter online, on its own
device. A thin shell over the core's `Calibrator` and `CalibrationLoop`: drafters send it finished
sequences' rounds (`add`, fire and forget), its loop trains at most once per interval, and the
Router takes a winning candidate (`take_candidate`: its weights go through the object store once,
to every drafter) and tells it which version serves (`set_serving`)."""

from __future__ import annotations

import os

import torch


class Calibrator:
    def __init__(self, cfg, device: str = "cpu", threads: int = 1, first_version: int = 1,
                 stall_after_s: float = 120.0):
        """`cfg`: a speculative.drafter_config.DrafterConfig (validated in the Router's process);
        `stall_after_s`: parallel.stall_after_s (the bound its heartbeat is judged by)."""
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        torch.set_num_threads(threads)
        from dspark_cluster.speculative.calibrator import CalibrationLoop, Calibrator as CoreCalibrator

        self.cfg = cfg
        dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")  # Ray sets CUDA_VISIBLE_DEVICES
        self.core = CoreCalibrator(cfg, cfg.target_spec, dev, first_version=first_version,
                                   stall_after_s=stall_after_s)
        self.loop = CalibrationLoop(self.core, self.cfg.speculative.calibration.interval_s)

    def ready(self) -> bool:
        return True

    def add(self, samples) -> None:
        self.core.add(samples)

    def take_candidate(self):
        """None, or (version, meta, a reference to its weights in the object store)."""
        import ray

        c = self.core.take_candidate()
        return None if c is None else (c.version, c.meta, ray.put(c.state))

    def set_serving(self, version: int, keep=None) -> None:
        self.core.set_serving(version, keep)

    def status(self) -> dict:
        return self.core.status()

    def heartbeat(self) -> dict:
        """What the training thread is doing and when it last progressed (answered on another of the
        actor's threads: max_concurrency > 1, so a hung update does not hold it)."""
        return self.core.heartbeat.snapshot()

    def memory_report(self) -> dict:
        return self.core.memory_report()

    def updates_log(self) -> list:
        return self.core.updates_log()

    def shutdown(self) -> None:
        self.loop.stop()
