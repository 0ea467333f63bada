"""The layering: the core never imports the Ray side, parallel/ never imports the core (import-linter's
contracts in pyproject.toml), no import cycle among the project's modules (counting imports inside
functions) nor between the packages, and the step contract is a leaf."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dspark_cluster", "actors", "parallel")


def test_import_contracts_hold():
    res = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                          "sys.exit(lint_imports_command())"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3 kept, 0 broken" in res.stdout, res.stdout


def import_cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    modules = sorted(m for m in graph.modules if m.split(".")[0] in PACKAGES)
    edges = {m: sorted(n for n in graph.find_modules_directly_imported_by(m) if n.split(".")[0] in PACKAGES)
             for m in modules}
    index, low, on, stack, comps = {}, {}, set(), [], []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on.add(v)
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            for w in edges[v]:
                if w in on:
                    low[v] = min(low[v], low[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return comps


def test_no_import_cycle():
    graph = grimp.build_graph(*PACKAGES)  # every import statement, those inside functions included
    assert "actors.cluster" in graph.find_modules_directly_imported_by("actors.backend")
    assert import_cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    class Graph:
        modules = {"actors.a", "actors.b", "actors.c", "dspark_cluster.d"}
        imports = {"actors.a": {"actors.b"}, "actors.b": {"actors.c"}, "actors.c": {"actors.a"}, "dspark_cluster.d": set()}

        def find_modules_directly_imported_by(self, m):
            return self.imports[m]

    assert import_cycles(Graph()) == [["actors.a", "actors.b", "actors.c"]]


def test_the_step_contract_is_a_leaf():
    """A worker that unpickles a StepInput imports the contract and the speculative records only:
    not the scheduler, the engine, the drafter's trainer (DeepSpeed) or transformers."""
    graph = grimp.build_graph(*PACKAGES)
    leaf = {"dspark_cluster.step", "dspark_cluster.speculative.records"}
    for module in leaf:
        inside = {m for m in graph.find_modules_directly_imported_by(module) if m.split(".")[0] in PACKAGES}
        assert inside <= leaf | {"dspark_cluster", "dspark_cluster.speculative"}, (module, inside - leaf)
    code = ("import sys, pickle, torch; import dspark_cluster.step as s; "
            "x = s.from_wire(s.to_wire(s.StepOutput(sampled=torch.zeros(1, 1, dtype=torch.long), "
            "num_tokens=torch.ones(1, dtype=torch.long)))); "
            "print(sorted(m for m in sys.modules if m.startswith(('dspark_cluster', 'deepspeed', 'transformers', "
            "'ray', 'parallel', 'actors'))))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert eval(res.stdout) == ["dspark_cluster", "dspark_cluster.speculative", "dspark_cluster.speculative.records",
                                "dspark_cluster.step"]


def test_the_backend_registry_is_its_own_module():
    """Nothing in the core reaches up to the executor for the registry (the drafter group used to)."""
    graph = grimp.build_graph(*PACKAGES)
    assert graph.find_modules_directly_imported_by("dspark_cluster.backends") == set()
    for module in ("dspark_cluster.speculative.drafting", "dspark_cluster.runner"):
        assert "dspark_cluster.executor" not in graph.find_modules_directly_imported_by(module), module


def test_no_cycle_between_the_packages():
    """The core imports parallel/ (the torch.distributed layer) and is imported by actors/; never the
    other way (type annotations aside)."""
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    imports = {(a.split(".")[0], b.split(".")[0]) for a in graph.modules if a.split(".")[0] in PACKAGES
               for b in graph.find_modules_directly_imported_by(a) if b.split(".")[0] in PACKAGES}
    assert ("parallel", "dspark_cluster") not in imports and ("parallel", "actors") not in imports
    assert ("dspark_cluster", "actors") not in imports
