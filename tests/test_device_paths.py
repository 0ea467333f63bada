"""Device paths without a GPU: sampling, verification and the proposers run with their tensors on
`meta`, so a CPU tensor meeting a device tensor raises here as it does on CUDA.

A plain meta tensor has no values, and these paths branch on values (`bool(mask.any())`, `.tolist()`),
so the tensors here say they are on meta and keep their values in a CPU tensor (`OnDevice`). Every
op on them is first run on real meta tensors of the same shapes, with the CPU tensors left as they
are: meta's device rule (the same as CUDA's: CPU scalars mix with device tensors, nothing else does)
raises for a mixed op. Factories asked for `device=meta` give `OnDevice` tensors, a generator asked
for meta gives a CPU generator marked as on it, and a generator must be on the device of the tensor
it fills (as CUDA requires). Values are compared with the same calls on the CPU.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from dspark_cluster.sampling import filter_logits, sample
from dspark_cluster.speculative.spec_decode import verify

from conftest import VOCAB, build_dspark, random_prompts

DEV = torch.device("meta")
_Generator = torch.Generator


class OnDevice(torch.Tensor):
    """A tensor that says it is on meta and holds its values in a CPU tensor."""

    @staticmethod
    def __new__(cls, data):
        r = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                storage_offset=data.storage_offset(), dtype=data.dtype, device=DEV,
                                                requires_grad=False)
        r.cpu_data = data
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def tolist(self):  # as .tolist() of a CUDA tensor: a copy to the host
        return self.cpu_data.tolist()

    def __repr__(self):
        return f"OnDevice({self.cpu_data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


class _StandInGenerator(_Generator):
    """torch.Generator while the stand-in runs: device=meta gives a CPU generator marked as on meta."""

    def __new__(cls, device="cpu"):
        g = _Generator.__new__(cls)
        g.on_meta = torch.device(device).type == DEV.type
        return g

    def __init__(self, device="cpu"):
        pass


def _run(func, args, kwargs):
    leaves = tree_leaves((args, kwargs))
    if any(isinstance(x, torch.Tensor) and not isinstance(x, OnDevice) and x.is_meta for x in leaves):
        raise AssertionError(f"{func}: a meta tensor without values; its factory bypassed the stand-in")
    on_device = any(isinstance(x, OnDevice) for x in leaves) or (
        kwargs.get("device") is not None and torch.device(kwargs["device"]).type == DEV.type)
    if on_device:  # 1. the device rule: the op on meta tensors for the OnDevice ones, fresh CPU ones for the rest
        def stand_in(x):
            if not isinstance(x, torch.Tensor):
                return x
            if isinstance(x, OnDevice):
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=DEV)
            return torch.zeros(x.shape, dtype=x.dtype, device=x.device)  # fresh: an in-place op must not run twice

        meta_args, meta_kwargs = tree_map(stand_in, (args, kwargs))
        if "generator" in meta_kwargs:
            meta_kwargs["generator"] = None  # meta takes none; _Generators checks them
        try:
            func(*meta_args, **meta_kwargs)
        except RuntimeError as e:
            if "device" in str(e):
                raise
        except Exception:  # noqa: BLE001 -- data-dependent ops have no meta kernel
            pass
    # 2. the values, on the CPU
    inputs = {}

    def unwrap(x):
        if isinstance(x, OnDevice):
            inputs[id(x.cpu_data)] = x
            return x.cpu_data
        if isinstance(x, torch.device) and x.type == DEV.type:
            return torch.device("cpu")
        return x

    cpu_args, cpu_kwargs = tree_map(unwrap, (args, kwargs))
    out = func(*cpu_args, **cpu_kwargs)
    if func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None:
        on_device = torch.device(kwargs["device"]).type == DEV.type  # .to(device) / .cpu()
    if not on_device:
        return out
    # in-place ops give back their input; everything else made on the device stays there
    return tree_map(lambda x: (inputs[id(x)] if id(x) in inputs else OnDevice(x)) if isinstance(x, torch.Tensor) else x,
                    out)


class _Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


class _Generators(TorchFunctionMode):
    """Generators on the device of the tensors they fill; torch.tensor(..., device=meta) made OnDevice."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        gen = kwargs.get("generator")
        if gen is not None:
            gen_dev = DEV if getattr(gen, "on_meta", False) else gen.device
            on = [x.device for x in tree_leaves(args) if isinstance(x, torch.Tensor)][:1] or [kwargs.get("device")]
            dev = torch.device(on[0] if on[0] is not None else "cpu")
            if gen_dev.type != dev.type:
                raise RuntimeError(f"Expected a '{dev.type}' device type for generator but found '{gen_dev.type}'")
        if func in (torch.tensor, torch.as_tensor, torch.asarray) and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == DEV.type:  # these build their tensor without an op
            return OnDevice(func(*args, **{**kwargs, "device": "cpu"}))
        return func(*args, **kwargs)


class on_meta:
    """`with on_meta():` meta is the device (see the module's docstring), in this thread and in the
    threads started meanwhile (torch's modes are per thread; an engine may step in a thread of its own)."""

    def __enter__(self):
        self._gen, torch.Generator = torch.Generator, _StandInGenerator
        self._thread_run = run = threading.Thread.run

        def run_on_meta(thread):
            with _Generators(), _Dispatch():
                run(thread)

        threading.Thread.run = run_on_meta
        # inference mode refuses views of wrapper tensors ("Cannot set version_counter"): no_grad stands in
        im = torch.autograd.grad_mode.inference_mode
        self._im = im.__enter__, im.__exit__
        im.__enter__ = lambda s: setattr(s, "_stand_in", torch.no_grad()) or s._stand_in.__enter__()
        im.__exit__ = lambda s, *exc: s._stand_in.__exit__(*exc)
        self._modes = [_Generators(), _Dispatch()]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)
        im = torch.autograd.grad_mode.inference_mode
        im.__enter__, im.__exit__ = self._im
        torch.Generator = self._gen
        threading.Thread.run = self._thread_run


def cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


# ---------------------------------------------------------------------------------------- the stand-in

def test_the_stand_in_raises_where_cuda_would():
    with on_meta():
        x = torch.randn(3, 4).to(DEV)
        assert isinstance(x, OnDevice) and x.device == DEV
        y = x + torch.arange(4, device=x.device)  # a factory on the device
        assert torch.equal(cpu(y), cpu(x) + torch.arange(4))
        assert torch.equal(cpu(x * torch.tensor(2.0)), cpu(x) * 2)  # a CPU scalar mixes, as on CUDA
        x[0] = torch.zeros(4)  # a copy from the host is fine
        with pytest.raises(RuntimeError, match="device"):
            x + torch.ones(4)
        with pytest.raises(RuntimeError, match="device"):
            torch.where(x > 0, x, torch.zeros(3, 4))
        with pytest.raises(RuntimeError, match="generator"):
            torch.empty(4, device=DEV).exponential_(generator=torch.Generator())
        g = torch.Generator(device=DEV)
        g.manual_seed(1)
        torch.empty(4, device=DEV).exponential_(generator=g)
        with pytest.raises(RuntimeError, match="generator"):
            torch.rand(3, generator=g)


# ---------------------------------------------------------------------------------------- sampling

def _params(B, dev, greedy=False):
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9, 1.0][:B])
    if greedy:
        temp = torch.zeros(B)
    top_k = torch.tensor([0, 5, 0, 10, 3, 0][:B])
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.8, 1.0][:B])
    seeds = torch.tensor([-1, 3, 4, 9, 11, 5][:B])
    positions = torch.tensor([0, 2, 5, 1, 7, 3][:B])
    return [t.to(dev) for t in (temp, top_k, top_p, seeds, positions)]


def test_filter_logits_and_sample_on_the_device():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    ref_law = filter_logits(logits, *_params(6, "cpu")[:3])
    ref = sample(logits, *_params(6, "cpu"))
    with on_meta():
        L = logits.to(DEV)
        law = filter_logits(L, *_params(6, DEV)[:3])
        assert law.device == DEV
        torch.testing.assert_close(cpu(law), ref_law)
        tok = sample(L, *_params(6, DEV))
        assert tok.device == DEV and torch.equal(cpu(tok)[1:], ref[1:])  # row 0 greedy, the others seeded
        assert int(cpu(tok)[0]) == int(logits[0].argmax())
        assert torch.equal(cpu(sample(L, *_params(6, DEV, greedy=True))), logits.argmax(-1))
        with pytest.raises(RuntimeError, match="device"):  # parameters left on the CPU
            filter_logits(L, *_params(6, "cpu")[:3])


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("one_hot", [True, False])
def test_verify_on_the_device(greedy, one_hot):
    torch.manual_seed(1)
    S, K = 5, 3
    target = torch.randn(S, K + 1, VOCAB)
    drafts = torch.randint(0, VOCAB, (S, K))
    drafts[0] = target[0, :K].argmax(-1)  # a row whose drafts the target agrees with
    num_draft = torch.tensor([3, 2, 0, 1, 3])
    probs = None if one_hot else torch.rand(S, K, VOCAB).softmax(-1)
    args = lambda dev: (target.to(dev), drafts.to(dev), num_draft.to(dev), None if one_hot else probs.to(dev),  # noqa: E731
                        *_params(S, dev, greedy))
    ref_tokens, ref_n = verify(*args("cpu"))
    with on_meta():
        tokens, n = verify(*args(DEV))
        assert tokens.device == DEV and n.device == DEV
        seeded = slice(None) if greedy else slice(1, None)  # every row greedy, or row 0 greedy and the rest seeded
        assert torch.equal(cpu(n)[seeded], ref_n[seeded])
        for s in range(S)[seeded]:
            assert cpu(tokens)[s, : int(ref_n[s])].tolist() == ref_tokens[s, : int(ref_n[s])].tolist()
        if not greedy:  # sampling parameters left on the CPU (every row greedy reads none of them)
            with pytest.raises(RuntimeError, match="device"):
                verify(*args(DEV)[:4], *_params(S, "cpu", greedy))


# ---------------------------------------------------------------------------------------- proposers

def _requests(temps):
    from dspark_cluster.speculative.proposers import DraftRequest

    prompts = random_prompts([10, 4, 17], seed=7)
    return [DraftRequest(1, prompts[0], 3, temps[0], 5, 0.9, 7, 0),
            DraftRequest(2, prompts[1], 2, temps[1], 0, 1.0, 4, 2),
            DraftRequest(3, prompts[2], 4, temps[2], 0, 0.8, 11, 3)]


def _same_proposals(ref, got):
    for a, b in zip(ref, got):
        assert a.tokens == b.tokens
        assert not isinstance(b.probs, OnDevice) and not isinstance(b.confidences, OnDevice)  # handed back on the host
        torch.testing.assert_close(b.probs, a.probs)
        torch.testing.assert_close(b.confidences, a.confidences)


@pytest.mark.parametrize("temps", [(0.8, 0.0, 1.0), (0.0, 0.0, 0.0)], ids=["sampled", "greedy"])
def test_draft_model_proposer_samples_its_drafts_on_the_device(checkpoint, temps):
    """Its sampling builds the temperature / top-k / top-p of the batch on the logits' device."""
    from dspark_cluster.model.spec import load_spec
    from dspark_cluster.speculative.proposers import DraftModelProposer

    spec = load_spec(str(checkpoint("qwen3_moe")), "float32")
    make = lambda dev: DraftModelProposer(str(checkpoint("qwen3")), spec, "float32", dev, block_size=4,  # noqa: E731
                                          kv_cache_memory=2**20)
    ref = make("cpu").propose(_requests(temps))
    with on_meta():
        prop = make(DEV)
        assert prop.model.lm_head.weight.device == DEV
        _same_proposals(ref, prop.propose(_requests(temps)))  # every row greedy or seeded: the same drafts


@pytest.mark.parametrize("temps", [(0.8, 0.0, 1.0), (0.0, 0.0, 0.0)], ids=["sampled", "greedy"])
def test_dspark_proposer_samples_its_drafts_on_the_device(checkpoint, tmp_path_factory, temps):
    from dspark_cluster.model.spec import load_spec
    from dspark_cluster.speculative.records import ContextRows
    from dspark_cluster.speculative.dspark_proposer import DSparkProposer

    target = checkpoint("qwen3_moe")
    drafter = build_dspark(target, tmp_path_factory.mktemp("dspark-device"), layers=(0, 1))
    spec = load_spec(str(target), "float32")
    torch.manual_seed(2)
    reqs = _requests(temps)
    lens = [len(r.token_ids) - 1 for r in reqs]  # each sequence's context: every token but the anchor
    rows = ContextRows(torch.tensor([r.seq_id for r in reqs]), torch.zeros(3, dtype=torch.long), torch.tensor(lens),
                       torch.randn(sum(lens), 2 * spec.hidden_size))
    make = lambda dev: DSparkProposer(drafter, str(target), spec, dev, 4)  # noqa: E731
    ref_prop = make("cpu")
    ref_prop.ingest(rows)
    ref = ref_prop.propose(reqs)
    with on_meta():
        prop = make(DEV)
        assert next(prop.model.parameters()).device == DEV
        prop.ingest(rows)
        _same_proposals(ref, prop.propose(_requests(temps)))


# ---------------------------------------------------------------------------------------- the engine

@pytest.mark.parametrize("method", ["draft_model", "dspark"])
def test_in_process_speculative_decoding_on_the_device(checkpoint, tmp_path_factory, monkeypatch, method):
    """executor local, the whole step (target forward, sampling, verification, logprobs) and the
    drafter on the device: the same tokens as on the CPU, and drafts were verified (a drafter that
    fails on the device is dropped, and the engine carries on without speculation)."""
    import dspark_cluster.executor as executor
    from dspark_cluster import LLM, SamplingParams

    target = checkpoint("qwen3_moe")
    draft = checkpoint("qwen3") if method == "draft_model" else \
        build_dspark(target, tmp_path_factory.mktemp("dspark-engine"), layers=(0, 1))
    cfg = {"parallel": {"executor": "local"}, "scheduler": {"block_size": 4, "num_kv_blocks": 64},
           "speculative": {"method": method, "draft_model": str(draft), "num_tokens": 3, "schedule": "static"}}
    prompts = random_prompts([5, 9], seed=3)
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=5, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1)]
    with LLM(str(target), config=cfg) as llm:
        ref = llm.generate(prompts, params)
    monkeypatch.setattr(executor, "resolve_device", lambda device: DEV)
    with on_meta():
        with LLM(str(target), config=cfg) as llm:
            assert llm.engine.executor.model.lm_head.weight.device == DEV
            outs = llm.generate(prompts, params)
    for a, b in zip(ref, outs):
        assert b.token_ids == a.token_ids
        assert b.metrics["num_draft_tokens"] == a.metrics["num_draft_tokens"] > 0
    lp = lambda out: [(t.token_id, t.logprob, t.top) for t in out.logprobs]  # noqa: E731
    got, want = lp(outs[1]), lp(ref[1])
    assert [t[0] for t in got] == [t[0] for t in want] and len(got) == 8
    torch.testing.assert_close(torch.tensor([t[1] for t in got]), torch.tensor([t[1] for t in want]))
    assert len(outs[1].prompt_logprobs) == len(prompts[1])
