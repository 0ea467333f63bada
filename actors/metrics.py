"""Prometheus metrics through Ray's metrics API (exported by each node's metrics agent): the Ray
sink of dspark_cluster.metrics, whose table names and defines every metric and whose EngineMetrics
writes them. Each sample carries the served model's name as the `model` tag."""

from __future__ import annotations

from typing import Optional

from ray.util.metrics import Counter, Gauge, Histogram

from dspark_cluster.metrics import C, H, EngineMetrics, definition


class RaySink:
    """ray.util.metrics objects, declared from the table on first write."""

    def __init__(self, model_name: str):
        self.tags = {"model": model_name}
        self._metrics: dict = {}

    def get(self, name: str, help_text: Optional[str] = None):
        m = self._metrics.get(name)
        if m is None:
            d = definition(name, help_text)
            keys = ("model", *d.labels)
            if d.kind == H:
                m = Histogram(d.name, d.meaning, boundaries=list(d.buckets), tag_keys=keys)
            else:
                m = (Counter if d.kind == C else Gauge)(d.name, d.meaning, tag_keys=keys)
            self._metrics[name] = m
        return m

    def _tags(self, labels: Optional[dict]) -> dict:
        return {**self.tags, **labels} if labels else self.tags

    def set(self, name: str, value: float, labels: Optional[dict] = None, help_text: Optional[str] = None) -> None:
        self.get(name, help_text).set(value, self._tags(labels))

    def inc(self, name: str, value: float = 1.0, labels: Optional[dict] = None) -> None:
        self.get(name).inc(value, self._tags(labels))

    def observe(self, name: str, value: float, labels: Optional[dict] = None) -> None:
        self.get(name).observe(value, self._tags(labels))


class RayMetrics(EngineMetrics):
    """The Router's metrics: the engine's, exported through Ray."""

    def __init__(self, model_name: str):
        super().__init__(RaySink(model_name))
