"""ctxfast xl-eval: the XL and vanilla modes agree where their contexts coincide, the
memory is handled across segments, the command line validates its flags, and a tiny run
writes the table, JSON, markdown and plot."""
import json
import sys
from dataclasses import asdict

import pytest
import torch

from ctxfast import cli
from ctxfast.eval import xl_eval
from ctxfast.models.transformer_xl import TransformerXL, TransformerXLConfig
from utils import assert_close


def tiny_model(**kw):
    cfg = dict(n_token=40, n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=48,
               dropout=0.0, dropatt=0.0)
    return TransformerXL(TransformerXLConfig(**{**cfg, **kw})).eval()


def stream(n, B=2, V=40):
    return torch.randint(0, V, (n + 1, B))          # [n + 1, B]: position p predicts row p + 1


@pytest.mark.parametrize("backend", ["ctxfast", "eager"])
def test_first_segment_equals_vanilla_where_contexts_coincide(backend):
    """Positions of the first XL segment (no memory yet) see the same tokens as the
    vanilla windows there, so their log-probabilities agree; later positions see more
    through the memory's recurrence and differ."""
    model = tiny_model(backend=backend)
    data = stream(20)
    xl, _, _ = xl_eval.xl_log_probs(model, data, tgt_len=6, mem_len=6)
    first = [(p, b) for p in range(6) for b in range(2)]
    van, _ = xl_eval.vanilla_log_probs(model, data, attn_len=12, positions=first, batch=3)
    assert_close(van, xl[[p for p, _ in first], [b for _, b in first]])
    # p = L - 1 with an XL memory holding the whole past: the same full context again
    late = [(11, 0), (11, 1)]
    van_late, _ = xl_eval.vanilla_log_probs(model, data, attn_len=12, positions=late, batch=2)
    xl_all, _, _ = xl_eval.xl_log_probs(model, data, tgt_len=6, mem_len=20)
    assert_close(van_late, xl_all[11])
    # With 6 steps of memory, the third segment's XL contexts (positions 12-17) differ from
    # their 12-token windows: layer 0's memory carries positions 0-5 in. At one position the
    # change in log-probability can be as small as rounding (position 17 of stream 0: 0 to
    # 9e-6 over 24 seeds, under 1e-6 in half of them); over the segment's 12 positions its
    # largest was 3.4e-4 to 1.1e-3 on every seed.
    third = [(p, b) for p in range(12, 18) for b in range(2)]
    van3, _ = xl_eval.vanilla_log_probs(model, data, attn_len=12, positions=third, batch=4)
    diff = (van3 - xl[[p for p, _ in third], [b for _, b in third]]).abs().max().item()
    assert diff > 1e-5, f"XL and vanilla log-probs agree to {diff:.1e} where contexts differ"


@pytest.mark.parametrize("backend", ["ctxfast", "eager"])
def test_the_profile_compares_equal_contexts(backend):
    """The paper's setting: XL with mem_len = L and same_length, so that each XL query sees
    the L tokens a vanilla window of length L sees. With one layer (no deeper recurrence
    through the memory) the two give the same log-probabilities at every sampled position
    (weights of scale 0.3: the context matters). Before, mem_len = L - tgt_len: an XL query
    saw L - tgt_len + 1 .. L keys (bits/tok 0.013 and 0.039 apart here), an XL cost too low."""
    torch.manual_seed(0)
    cfg = TransformerXLConfig(n_token=40, n_layer=1, n_head=2, d_model=32, d_head=16,
                              d_inner=48, dropout=0.0, dropatt=0.0, init_std=0.3,
                              proj_init_std=0.3)
    model = TransformerXL(cfg).eval()
    s = xl_eval.Settings(attn_lens=(8, 13), tgt_len=4, batch=2, xl_segments=3,
                         vanilla_positions=8, model=cfg, backends=(backend,))
    ids = torch.randint(0, 40, (400,))
    rows = xl_eval.profile(model, ids, s)
    for r in rows:
        assert r["mem_len"] == r["attn_len"]
        assert r["xl_bits_per_token"] == pytest.approx(r["vanilla_bits_per_token"], abs=1e-5), r
    assert model.mem_len == cfg.mem_len and model.same_length == cfg.same_length   # restored


def test_vanilla_windows_are_full_forwards_of_L_tokens():
    model = tiny_model()
    data = stream(30, B=3)
    pos = xl_eval.sample_positions(9, 29, 7, batch=3)
    assert len(pos) == 7 and all(9 <= p <= 29 and 0 <= b < 3 for p, b in pos)
    van, _ = xl_eval.vanilla_log_probs(model, data, attn_len=10, positions=pos, batch=4)
    for i, (p, b) in enumerate(pos):
        with torch.no_grad():
            lp, _ = model(data[p - 9:p + 1, b:b + 1])          # [10, 1, V], no memory
        assert_close(van[i], lp[-1, 0, data[p + 1, b]], name=f"position {p}, stream {b}")


def test_memory_across_segments():
    """xl_log_probs carries the memory: each segment gets the last mem_len hidden states
    of the previous ones (detached), and the result equals a hand-written segment loop."""
    model = tiny_model()
    data = stream(21)
    seen = []
    real = model.log_probs

    def spy(x, *mems, **kw):
        seen.append([(m.shape[0], m.requires_grad) for m in mems])
        return real(x, *mems, **kw)
    model.log_probs = spy
    xl, ms, tokens = xl_eval.xl_log_probs(model, data, tgt_len=4, mem_len=6, time_from=2)
    del model.log_probs
    assert [s[0][0] if s else 0 for s in seen] == [0, 4, 6, 6, 6, 6]
    assert all(not g for s in seen for _, g in s) and all(len(s) == 3 for s in seen)
    assert tokens == 4 * 2 and len(ms) == 3 and min(ms) > 0   # segments 2-4 (5 is short)
    model.reset_length(4, 0, 6)
    mems, ref = model.init_mems(), []
    with torch.no_grad():
        for s in range(0, 21, 4):
            e = min(s + 4, 21)
            x, y = data[s:e], data[s + 1:e + 1]
            nll, mems = model(x, y, *mems)
            ref.append(-nll)
    assert_close(xl, torch.cat(ref))


def test_interleaved_backends_keep_their_own_memory():
    """The interleaved XL mode (both backends per segment, for timings that share the
    machine's moments) gives each backend exactly what it gives alone: its own memory,
    its own log-probabilities, one timing per timed segment; and the backends agree."""
    model = tiny_model()
    data = stream(21)
    runs = xl_eval.xl_log_probs_interleaved(model, data, tgt_len=4, mem_len=6,
                                            backends=("ctxfast", "eager"), time_from=2)
    assert set(runs) == {"ctxfast", "eager"}
    for backend in ("ctxfast", "eager"):
        model.set_backend(backend)
        alone, _, _ = xl_eval.xl_log_probs(model, data, tgt_len=4, mem_len=6)
        xl, ms, tokens = runs[backend]
        assert torch.equal(xl, alone), backend
        assert tokens == 4 * 2 and len(ms) == 3 and min(ms) > 0
    assert_close(runs["ctxfast"][0], runs["eager"][0], name="ctxfast vs eager")


def test_interleaved_vanilla_matches_each_backend_alone():
    """The interleaved vanilla mode (the backends forward by forward) gives each backend
    what it gives alone, short positions (p < L - 1) included, one timing per full
    forward; and the backends agree."""
    model = tiny_model()
    data = stream(30, B=3)
    pos = [(4, 1)] + xl_eval.sample_positions(9, 29, 7, batch=3)     # one short position
    runs = xl_eval.vanilla_log_probs_interleaved(model, data, 10, pos, 3,
                                                 ("eager", "ctxfast"))
    assert set(runs) == {"ctxfast", "eager"}
    for backend in ("ctxfast", "eager"):
        model.set_backend(backend)
        alone, _ = xl_eval.vanilla_log_probs(model, data, attn_len=10, positions=pos, batch=3)
        van, ms = runs[backend]
        assert torch.equal(van, alone), backend
        assert len(ms) == 3 and min(ms) > 0                  # 7 full windows, 3 per forward
    assert_close(runs["ctxfast"][0], runs["eager"][0], name="ctxfast vs eager")


def test_builtin_stream_is_deterministic_and_encodes():
    a, b = xl_eval.builtin_text(500, seed=3), xl_eval.builtin_text(500, seed=3)
    assert a == b and len(a) == 500 and a != xl_eval.builtin_text(500, seed=4)
    ids, vocab, _ = xl_eval.encode("héllo", "byte")
    assert vocab == 256 and ids.tolist() == list("héllo".encode())
    ids, vocab, _ = xl_eval.encode("abca", "char")
    assert vocab == 3 and ids.tolist() == [0, 1, 2, 0]


def test_streams_positions_warm_up_and_medians():
    """The helpers behind the table: ``batch`` contiguous streams (column b is the b-th
    part of the stream, as the original evaluation cuts it); positions spread evenly over
    ``[lo, hi]``, both ends included, every (position, stream) pair once when the count
    allows; warm-up segments until the memory of L is full (L not a multiple of the
    segment length: rounded up); the median of an even count is the middle pair's mean."""
    ids = torch.arange(20)
    m = xl_eval.stream_matrix(ids, batch=3, length=5)                   # [6, 3]
    assert m.shape == (6, 3)
    for b in range(3):
        assert m[:, b].tolist() == list(range(6 * b, 6 * b + 6)), b
    every = {(p, b) for p in range(3, 8) for b in range(2)}
    assert sorted(xl_eval.sample_positions(3, 7, 10, batch=2)) == sorted(every)
    assert sorted(xl_eval.sample_positions(3, 7, 99, batch=2)) == sorted(every)
    some = xl_eval.sample_positions(3, 7, 4, batch=2)
    assert [p for p, _ in some] == [3, 4, 5, 6] and [b for _, b in some] == [0, 1, 0, 1]
    assert xl_eval.sample_positions(5, 4, 3, batch=2) == []
    assert [xl_eval.fill_segments(L, 4) for L in (2, 4, 8, 10)] == [1, 1, 2, 3]
    assert xl_eval._median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert xl_eval._median([3.0, 1.0, 2.0]) == 2.0


# --------------------------------------------------------------------------- command line

TINY = ["--attn-lens", "8,16", "--tgt-len", "4", "--batch", "2", "--xl-segments", "2",
        "--vanilla-positions", "3", "--model", "tiny", "--n-layer", "1", "--no-progress"]


def _bad_args(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    short = tmp_path / "short.txt"
    short.write_text("abc")
    yield ["--attn-lens", "0"], "--attn-lens"
    yield ["--attn-lens", "8,x"], "--attn-lens"
    yield ["--backends", "eager,eager"], "--backends: each backend once"
    yield ["--tgt-len", "0"], "--tgt-len"
    yield ["--batch", "-2"], "--batch"
    yield ["--vanilla-positions", "zero"], "--vanilla-positions"
    yield ["--backends", "triton"], "--backends"
    yield ["--level", "word"], "--level"
    yield ["--dtype", "int8"], "--dtype"
    yield ["--text", str(tmp_path / "missing.txt")], "--text: no such file"
    yield ["--text", str(empty)], "--text: the file is empty"
    yield ["--text", str(short)] + TINY, "--text: 3 tokens"
    yield ["--checkpoint", str(tmp_path / "missing.pt")], "--checkpoint: no such file"
    yield ["--device", "tpu"], "--device"
    yield ["--bogus"], "unrecognized arguments"
    if not torch.cuda.is_available():
        yield ["--device", "cuda"], "--device cuda: no CUDA device"


def test_cli_rejects_bad_flags_naming_them(tmp_path, capsys):
    for args, msg in _bad_args(tmp_path):
        with pytest.raises(SystemExit) as e:
            cli.main(["xl-eval", *args])
        assert e.value.code == 2, args
        err = capsys.readouterr().err
        assert msg in err, f"{args}: {msg!r} not in {err!r}"


def test_cli_rejects_a_checkpoint_too_small_for_the_stream(tmp_path, capsys):
    small = tiny_model(n_token=40)
    path = tmp_path / "ckpt.pt"
    torch.save(small.state_dict(), path)
    with pytest.raises(SystemExit):
        cli.main(["xl-eval", *TINY, "--checkpoint", str(path)])        # byte ids go to 255
    assert "n_token=40" in capsys.readouterr().err


def _bad_checkpoints(tmp_path):
    """Files torch.load cannot read (each raised its own uncaught error: UnpicklingError,
    EOFError, KeyError) and contents that are no checkpoint of the model (TypeError)."""
    sd = tiny_model(n_token=256).state_dict()
    yield "garbage", bytes(range(256)) * 2, "--checkpoint: cannot read"
    yield "empty", b"", "--checkpoint: cannot read"
    yield "text", b"hello world\n", "--checkpoint: cannot read"
    yield "bogus-config", {"state_dict": sd, "config": {"bogus": 1}}, \
        "--checkpoint: its 'config' does not fit TransformerXLConfig"
    yield "state-dict-not-a-dict", {"state_dict": [1, 2]}, \
        "--checkpoint: its 'state_dict' must be a dict"


def test_cli_reports_an_unreadable_or_unfitting_checkpoint_as_a_flag_error(tmp_path, capsys):
    for name, content, msg in _bad_checkpoints(tmp_path):
        path = tmp_path / f"{name}.pt"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            torch.save(content, path)
        with pytest.raises(SystemExit) as e:
            cli.main(["xl-eval", *TINY, "--checkpoint", str(path)])
        assert e.value.code == 2, name
        err = capsys.readouterr().err
        assert f"xl-eval: error: {msg}" in err, f"{name}: {msg!r} not in {err!r}"


def test_cli_smoke_tiny_run_writes_the_report(tmp_path, capsys):
    out = tmp_path / "report"
    assert cli.main(["xl-eval", *TINY, "--out", str(out), "--json", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    assert "speedup" in printed and "vanilla ms/tok" in printed
    data = json.loads((tmp_path / "r.json").read_text())
    assert json.loads((out / "xl_eval.json").read_text())["rows"] == data["rows"]
    rows = data["rows"]
    assert [(r["attn_len"], r["backend"]) for r in rows] == \
        [(8, "ctxfast"), (8, "eager"), (16, "ctxfast"), (16, "eager")]
    for r in rows:
        for key in ("attn_len", "vanilla_ms_per_token", "xl_ms_per_token", "speedup", "backend",
                    "device", "vanilla_bits_per_token", "xl_bits_per_token", "vanilla_positions",
                    "xl_kernel_speedup", "attention"):
            assert key in r, key
        assert r["vanilla_positions"] == 3 and r["mem_len"] == r["attn_len"]
        assert r["speedup"] == pytest.approx(r["vanilla_ms_per_token"] / r["xl_ms_per_token"])
        # ms/tok: every timed step's time over its tokens (the medians beside)
        assert r["xl_ms_per_token"] == pytest.approx(r["xl_ms_total"] / r["xl_tokens_timed"])
        assert r["vanilla_ms_per_token"] == pytest.approx(r["vanilla_ms_total"] / 3)
        assert r["xl_ms_per_token_median"] > 0 and r["vanilla_ms_per_token_median"] > 0
        assert 0 < r["vanilla_bits_per_token"] < 16 and 0 < r["xl_bits_per_token"] < 16
        # the kernel gains: eager's ms/tok over this backend's, in the same mode and L
        e = next(x for x in rows if x["attn_len"] == r["attn_len"] and x["backend"] == "eager")
        for mode in ("xl", "vanilla"):
            assert r[f"{mode}_kernel_speedup"] == pytest.approx(
                e[f"{mode}_ms_per_token"] / r[f"{mode}_ms_per_token"]), mode
        assert r["speedup_vs_eager_vanilla"] == pytest.approx(
            e["vanilla_ms_per_token"] / r["xl_ms_per_token"])
    # same model and weights in both backends: the same bits per token
    assert rows[0]["xl_bits_per_token"] == pytest.approx(rows[1]["xl_bits_per_token"], rel=1e-4)
    assert "| L |" in (out / "xl_eval.md").read_text()
    try:
        import matplotlib  # noqa: F401
        assert (out / "xl_eval.png").stat().st_size > 0
    except ImportError:
        assert not (out / "xl_eval.png").exists()


def test_cli_reuse_kv_flag(tmp_path, capsys):
    """ctxfast keeps the memory's keys and values by default and says so (the attention
    column, the JSON meta, the notes); --no-reuse-kv recomputes them as the original. Both
    give the same bits per token."""
    rows = {}
    for flag in ((), ("--no-reuse-kv",)):
        path = tmp_path / f"r{len(flag)}.json"
        assert cli.main(["xl-eval", *TINY, *flag, "--json", str(path)]) == 0
        printed = capsys.readouterr().out
        data = json.loads(path.read_text())
        want = not flag
        assert data["meta"]["reuse_kv"] is want
        assert data["meta"]["model_config"]["reuse_kv"] is want
        ours = [r for r in data["rows"] if r["backend"] == "ctxfast"]
        assert all(r["attention"].endswith("+ K/V reuse") is want for r in ours)
        assert ("keeps the memory's keys" in " ".join(printed.split())) is want
        rows[flag] = ours
    for a, b in zip(rows[()], rows[("--no-reuse-kv",)]):
        assert a["xl_bits_per_token"] == pytest.approx(b["xl_bits_per_token"], rel=1e-5)


def test_cli_text_char_level_checkpoint_and_no_matplotlib(tmp_path, capsys, monkeypatch):
    text = tmp_path / "t.txt"
    text.write_text(xl_eval.builtin_text(300, seed=1))
    n_chars = len(set(text.read_text()))
    model = tiny_model(n_token=n_chars, n_layer=1)
    ckpt = tmp_path / "m.pt"
    torch.save({"config": asdict(model.config), "state_dict": model.state_dict()}, ckpt)
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import fails
    assert cli.main(["xl-eval", *TINY, "--text", str(text), "--level", "char",
                     "--checkpoint", str(ckpt), "--backends", "eager",
                     "--plot", str(tmp_path / "p.png")]) == 0
    captured = capsys.readouterr()
    assert "matplotlib is not installed" in captured.err and not (tmp_path / "p.png").exists()
    assert "d_model 32" in captured.out and "char-level" in captured.out


def test_cli_builds_a_long_enough_stream(tmp_path):
    # the stream's length and the run's untimed segments are one rule (fill_segments):
    # they disagreed by a segment, which the built-in stream's 16 spare tokens hid only
    # while a segment held fewer ("the token stream has 8084 tokens, 8196 are needed" for
    # --quick)
    args = ["--attn-lens", "16", "--tgt-len", "8", "--batch", "4", "--xl-segments", "1",
            "--vanilla-positions", "2", "--model", "tiny", "--n-layer", "1", "--no-progress",
            "--backends", "eager", "--json", str(tmp_path / "r.json")]
    assert cli.main(["xl-eval", *args]) == 0
    assert xl_eval.fill_segments(16, 8) == 2 and xl_eval.fill_segments(3, 8) == 1
