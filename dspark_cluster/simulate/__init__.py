"""The topology simulator (`dspark simulate`): the engine's own Scheduler, BlockManager, verify
budget, EPLB policy and cost ledger on a virtual clock, with a device cost model (`cost_model.py`,
a roofline per operation from the step's shapes; `assets/hardware.yaml`, the catalog) where the
workers would run. Importable without Ray; no weights are loaded (a config.json is enough)."""

from .hardware import Device, get_device, load_catalog
from .options import SimOptions, load_options
from .run import simulate

__all__ = ["Device", "SimOptions", "get_device", "load_catalog", "load_options", "simulate"]
