"""ctxfast.models.gpt: backend="ctxfast" against backend="eager" (outputs and every
parameter's gradient), generation with and without the key/value cache, training, torch.compile
and input checks. Toy sizes: the Triton kernels run in the interpreter on CPU.

The "ctxfast" model runs its attention under ``ctxfast.backend("triton")`` wherever the Triton
kernels can run (CPU with TRITON_INTERPRET=1, or CUDA), so the kernels themselves are what
is compared with the eager reference; elsewhere it runs on the dispatch default.
"""
import contextlib

import pytest
import torch

import ctxfast
from ctxfast.models import GPT, GPTConfig
from ctxfast.models._common import KVCache, KVMemory
from utils import DEVICE, assert_close, assert_within_2x_eager, owns_storage

TRITON = ctxfast.why_unavailable("triton", DEVICE) is None


def ops_backend():
    """The op backend the "ctxfast" models run on in these tests."""
    return ctxfast.backend("triton") if TRITON else contextlib.nullcontext()


def _config(**kw):
    base = dict(vocab_size=37, n_positions=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0,
                attn_dropout=0.0)
    base.update(kw)
    return GPTConfig(**base)


def _pair(**kw):
    """The same weights on both backends."""
    fast = GPT(_config(backend="ctxfast", **kw)).to(DEVICE)
    eager = GPT(_config(backend="eager", **kw)).to(DEVICE)
    eager.load_state_dict(fast.state_dict())
    return fast, eager


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("prenorm", [True, False], ids=["gpt2", "gpt1"])
def test_ctxfast_matches_eager_outputs_and_every_grad(prenorm):
    fast, eager = _pair(prenorm=prenorm, activation="gelu_tanh" if prenorm else "gelu")
    idx = torch.randint(0, 37, (2, 11), device=DEVICE)
    targets = torch.randint(0, 37, (2, 11), device=DEVICE)
    targets[0, :3] = -100                                    # ignored positions
    with ops_backend():
        logits, loss = fast(idx, targets)
        loss.backward()
    logits_e, loss_e = eager(idx, targets)
    loss_e.backward()
    assert_close(logits, logits_e, name="logits")
    assert_close(loss, loss_e, name="loss")
    g, g_e = _grads(fast), _grads(eager)
    assert g.keys() == g_e.keys() and len(g) == len(list(fast.parameters()))
    for name in g:
        assert g[name].abs().sum() > 0, f"{name}: zero gradient"
        assert_close(g[name], g_e[name], name=f"grad {name}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_within_twice_eager_error(dtype):
    """The flash-attention rule: in fp16/bf16, ‖ctxfast − fp64‖ <= 2·‖eager − fp64‖ + floor."""
    fast, eager = _pair()
    ref = GPT(_config(backend="eager")).to(DEVICE).double()
    ref.load_state_dict(fast.state_dict())
    fast, eager = fast.to(dtype), eager.to(dtype)
    idx = torch.randint(0, 37, (2, 9), device=DEVICE)
    with torch.no_grad():
        with ops_backend():
            out = fast(idx)[0]
        same = eager(idx)[0]
        out64 = ref(idx)[0]
    assert out.dtype == dtype
    floor = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]   # as tests/test_attention.py
    assert_within_2x_eager(out, same, out64, floor, name="logits")


def test_length_one_empty_and_non_contiguous_inputs():
    fast, eager = _pair(n_layer=1)
    wide = torch.randint(0, 37, (2, 14), device=DEVICE)
    for idx in (wide[:, :1], wide[:, ::2], wide[:0], wide[:, :0]):   # T=1, strided, B=0, T=0
        with torch.no_grad(), ops_backend():
            out = fast(idx)[0]
        ref = eager(idx)[0]
        assert out.shape == (*idx.shape, 37)
        if out.numel():
            assert_close(out, ref.detach(), name=f"logits for idx {tuple(idx.shape)}")


def test_layouts_differ_and_head_is_tied():
    gpt2, gpt1 = GPT(_config(prenorm=True)), GPT(_config(prenorm=False))
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert hasattr(gpt2.transformer, "ln_f") and not hasattr(gpt1.transformer, "ln_f")
    gpt1.load_state_dict({k: v for k, v in gpt2.state_dict().items() if "ln_f" not in k})
    idx = torch.randint(0, 37, (1, 5))
    assert not torch.allclose(gpt2(idx)[0], gpt1(idx)[0])
    untied = GPT(_config(tie_weights=False))
    assert untied.lm_head.weight is not untied.transformer.wte.weight


def _layout_reference(model, idx):
    """The forward written out from the state_dict in float64 (plain torch ops): GPT-2
    ``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``, ``ln_f``; GPT-1 ``ln_1(x + attn(x))``,
    ``ln_2(x + mlp(x))``, no ``ln_f``; logits through the tied head."""
    F = torch.nn.functional
    cfg, T = model.config, idx.shape[1]
    sd = {k: v.double() for k, v in model.state_dict().items()}
    H, D = cfg.n_head, cfg.n_embd

    def ln(x, name):
        return F.layer_norm(x, (D,), sd[name + ".weight"], sd[name + ".bias"],
                            cfg.layer_norm_eps)

    def lin(x, name):
        return F.linear(x, sd[name + ".weight"], sd[name + ".bias"])

    def attn(x, p):
        q, k, v = lin(x, p + "attn.qkv").split(D, -1)              # [B, T, D] each
        q, k, v = (t.view(*t.shape[:2], H, D // H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D/H]
        return lin(y.transpose(1, 2).reshape(x.shape), p + "attn.proj")

    def mlp(x, p):
        return lin(F.gelu(lin(x, p + "mlp.fc"), approximate="tanh"
                          if cfg.activation == "gelu_tanh" else "none"), p + "mlp.proj")

    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:T]
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        if cfg.prenorm:
            x = x + attn(ln(x, p + "ln_1"), p)
            x = x + mlp(ln(x, p + "ln_2"), p)
        else:
            x = ln(x + attn(x, p), p + "ln_1")
            x = ln(x + mlp(x, p), p + "ln_2")
    if cfg.prenorm:
        x = ln(x, "transformer.ln_f")
    return x @ sd["transformer.wte.weight"].t()


@pytest.mark.parametrize("prenorm", [True, False], ids=["gpt2", "gpt1"])
def test_both_layouts_against_the_written_out_forward(prenorm):
    """Each layout (and GPT-1's erf gelu) against its formula, every parameter perturbed so
    that the LayerNorms' places matter (GPT-2's layout is also checked against Hugging Face;
    GPT-1's only here)."""
    act = "gelu_tanh" if prenorm else "gelu"
    model = GPT(_config(prenorm=prenorm, activation=act, backend="eager")).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    idx = torch.randint(0, 37, (2, 9))
    with torch.no_grad():
        logits, _ = model(idx)
        ref = _layout_reference(model, idx)
    assert_close(logits, ref, name=f"logits, prenorm={prenorm}")


def test_cached_steps_match_one_full_pass():
    """Prefill 5 tokens, then one token at a time through the cache: the logits of every
    position equal those of one pass over the whole sequence."""
    model = GPT(_config()).to(DEVICE).eval()
    idx = torch.randint(0, 37, (2, 9), device=DEVICE)
    with torch.no_grad(), ops_backend():
        full, _ = model(idx)
        cache = KVCache(model.config.n_layer)
        outs = [model(idx[:, :5], cache=cache)[0]]
        for t in range(5, 9):
            outs.append(model(idx[:, t:t + 1], cache=cache)[0])
    assert cache.length == 9
    assert_close(torch.cat(outs, 1), full, name="cached logits")


def test_cache_grows_in_place_and_keeps_what_it_handed_out():
    """Without gradients a step writes its keys and values after the others in one buffer
    (no copy of the whole cache per token), the views an earlier step returned keep their
    values, and a model step through the cache equals one without it; with gradients the
    cache concatenates and gradients flow through it."""
    cache = KVCache(1)
    B, H, D = 2, 3, 4
    first = cache.update(0, torch.randn(B, H, 5, D), torch.randn(B, H, 5, D))
    saved = [t.clone() for t in first]
    ptrs = set()
    for _ in range(20):
        k, v = cache.update(0, torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
        ptrs.add(k.untyped_storage().data_ptr())
    assert cache.length == 25 and k.shape == (B, H, 25, D)
    assert len(ptrs) == 1                                # 64 rows of room: no new buffer
    assert torch.equal(first[0], saved[0]) and torch.equal(first[1], saved[1])
    assert torch.equal(k[:, :, :5], saved[0]) and torch.equal(v[:, :, :5], saved[1])
    for _ in range(40):                                  # past the room: one new buffer
        k, _ = cache.update(0, torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
    assert cache.length == 65 and torch.equal(k[:, :, :5], saved[0])
    kk = torch.randn(B, H, 2, D, requires_grad=True)     # gradients: concatenated
    grad_cache = KVCache(1)
    grad_cache.update(0, kk, kk * 2)
    k2, v2 = grad_cache.update(0, kk + 1, kk)
    (k2.sum() + v2.sum()).backward()
    assert torch.equal(kk.grad, torch.full_like(kk, 5.0))       # (1 + 1) + (2 + 1)


def test_generate_with_cache_equals_without():
    """Greedy decoding; 3 + 7 tokens with n_positions 8 also covers the sliding window (the
    cache is rebuilt once the context is full). A random model soon repeats one token, so
    the last-position logits of every step are recorded and compared too."""
    model = GPT(_config(n_positions=8)).to(DEVICE).eval()
    idx = torch.randint(0, 37, (2, 3), device=DEVICE)
    steps = []
    forward = model.forward

    def recording_forward(*args, **kw):
        logits, loss = forward(*args, **kw)
        steps[-1].append(logits[:, -1])
        return logits, loss

    model.forward = recording_forward
    results = []
    with ops_backend():
        for use_cache in (True, False):
            steps.append([])
            results.append(model.generate(idx, 7, temperature=0.0, use_cache=use_cache))
    cached, plain = results
    assert cached.shape == (2, 10)
    assert torch.equal(cached[:, :3], idx)
    assert torch.equal(cached, plain), (cached, plain)
    assert len(steps[0]) == len(steps[1]) == 7
    assert_close(torch.stack(steps[0]), torch.stack(steps[1]), name="logits of each step")
    # the eager backend generates the same tokens
    model.set_backend("eager")
    assert torch.equal(model.generate(idx, 7, temperature=0.0), cached)


def test_generate_sampling_top_k():
    model = GPT(_config(backend="eager")).eval()             # sampling is backend-independent
    idx = torch.randint(0, 37, (3, 2))
    gen = torch.Generator().manual_seed(0)
    out = model.generate(idx, 5, temperature=0.8, top_k=1, generator=gen)
    greedy = model.generate(idx, 5, temperature=0.0)
    out2 = model.generate(idx, 5, temperature=1.5, top_k=5, generator=gen)
    assert torch.equal(out, greedy)                          # top_k=1 is greedy
    assert out2.shape == (3, 7) and int(out2.min()) >= 0 and int(out2.max()) < 37
    assert torch.equal(model.generate(idx, 0), idx)


def test_one_optimizer_step_lowers_the_loss():
    model = GPT(_config()).to(DEVICE)
    idx = torch.randint(0, 37, (4, 12), device=DEVICE)
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with ops_backend():
        _, loss0 = model(x, y)
        loss0.backward()
        opt.step()
        _, loss1 = model(x, y)
    assert loss1.item() < loss0.item(), (loss0.item(), loss1.item())


def test_dropout_on_in_training_and_off_in_eval():
    model = GPT(_config(n_layer=1, dropout=0.3, attn_dropout=0.3)).to(DEVICE)
    idx = torch.randint(0, 37, (2, 6), device=DEVICE)
    with ops_backend():
        a, b = model(idx)[0], model(idx)[0]
        model.eval()
        c, d = model(idx)[0], model(idx)[0]
    assert not torch.equal(a, b)
    assert torch.equal(c, d)


def test_torch_compile_fullgraph_forward_backward():
    torch._dynamo.reset()
    model = GPT(_config(n_layer=1)).to(DEVICE)
    ref = GPT(_config(n_layer=1, backend="eager")).to(DEVICE)
    ref.load_state_dict(model.state_dict())
    idx = torch.randint(0, 37, (2, 7), device=DEVICE)
    compiled = torch.compile(model, fullgraph=True)          # inductor, as users compile
    with ops_backend():
        _, loss = compiled(idx, idx)
        loss.backward()
    _, loss_ref = ref(idx, idx)
    loss_ref.backward()
    assert_close(loss.detach(), loss_ref.detach(), name="loss")
    g, g_ref = _grads(model), _grads(ref)
    for name in g:
        assert_close(g[name], g_ref[name], name=f"grad {name}")


def test_bad_inputs_raise_clear_errors():
    model = GPT(_config())
    with pytest.raises(ValueError, match=r"idx must be in \[0, 37\)"):
        model(torch.tensor([[1, 37]]))
    with pytest.raises(ValueError, match=r"idx must be in \[0, 37\)"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="n_positions"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"idx must have shape \[B, T\]"):
        model(torch.zeros(17, dtype=torch.long))
    with pytest.raises(TypeError, match="idx must be an integer tensor"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="targets must have the shape of idx"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must be in"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4), 37))
    cache = KVCache(2)
    model(torch.zeros(1, 10, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="n_positions minus cached tokens"):
        model(torch.zeros(1, 7, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="backend"):
        GPT(_config(backend="triton"))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), -1)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 1, top_k=0)
    with pytest.raises(ValueError, match="at least one token"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="divisible"):
        GPT(_config(n_embd=30, n_head=4))


def test_inputs_on_another_device_are_refused():
    """Meta ids gave NaN logits on CPU; targets on another device an opaque torch error."""
    model = GPT(_config())
    idx = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="idx is on meta, the model on cpu"):
        model(idx.to("meta"))
    with pytest.raises(ValueError, match="targets is on meta, the model on cpu"):
        model(idx, idx.to("meta"))
    with pytest.raises(ValueError, match="idx is on meta, the model on cpu"):
        model.generate(idx.to("meta"), 2)


@pytest.mark.parametrize("grad", [False, True])
def test_cache_refuses_another_batch_naming_both(grad):
    """A cache filled with batch 1 and called with batch 2: without gradients the B=1 rows
    were broadcast silently, with them torch.cat failed opaquely."""
    model = GPT(_config())
    cache = KVCache(model.config.n_layer)
    with torch.set_grad_enabled(grad):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="KVCache holds a batch of B=1 .* the input has B=2"):
            model(torch.zeros(2, 1, dtype=torch.long), cache=cache)
        assert cache.length == 3
        one = KVCache(1)                             # the cache by itself, as SelfAttention uses it
        one.update(0, torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
        with pytest.raises(ValueError, match="KVCache holds a batch of B=1 .* the input has B=2"):
            one.update(0, torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    mem = KVMemory(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"KVMemory.extend: .* = \[1, 2, Q, 4\] .* got \[2, 2"):
        mem.extend(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))


def test_memory_buffer_room_is_bounded_by_its_rows():
    """A new buffer's room for the next rows is at most the rows it holds (and 128 rows at
    the least): at q = mem = 64 it held 640 rows for 128 (8 q of room)."""
    for m, q in ((64, 64), (512, 512), (3, 2), (1000, 10)):
        mem = KVMemory(torch.randn(1, 1, m, 4), torch.randn(1, 1, m, 4))
        k = torch.randn(1, 1, q, 4)
        new = mem.extend(k, k.clone())
        rows = new._buf[0].shape[2]
        assert m + q + min(q, 128) <= rows <= 2 * (m + q) + 128, (m, q, rows)
        assert torch.equal(new.k[:, :, m:], k) and not owns_storage(new.k)


def test_memory_extended_twice_at_once_keeps_both_branches_apart():
    """Two threads extending one memory at the same time (two requests on one prefix, in
    a server): each must keep its own rows. The interleaving is made deterministic here:
    the first extend's copy (its k_new a tensor subclass) runs the second extend in the
    middle, as another thread would while the copy holds no GIL. Checked then written, the
    second found the frontier still free and wrote the same rows, which the first then
    overwrote: the second branch's keys were the first's (3 of 400 branches in a
    Transformer-XL threaded run)."""
    class Interrupting(torch.Tensor):
        hook = None

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.copy_ and cls.hook is not None:
                hook, cls.hook = cls.hook, None
                hook()
            return super().__torch_function__(func, types, args, kwargs or {})

    base = KVMemory(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    mem = base.extend(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))   # a buffer with room
    k1, v1, k2, v2 = (torch.randn(1, 2, 2, 4) for _ in range(4))
    second = {}
    Interrupting.hook = lambda: second.update(m=mem.extend(k2, v2))
    first = mem.extend(k1.as_subclass(Interrupting), v1)
    assert "m" in second                                   # the interleaving happened
    assert torch.equal(torch.Tensor(first.k[:, :, -2:]), k1)
    assert torch.equal(second["m"].k[:, :, -2:], k2), "the second branch lost its keys"
    assert torch.equal(second["m"].v[:, :, -2:], v2)
    assert torch.equal(torch.Tensor(first.k[:, :, :5]), mem.k)
    assert torch.equal(second["m"].k[:, :, :5], mem.k)
