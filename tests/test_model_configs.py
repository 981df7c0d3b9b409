"""The models' configs refuse values that cannot work when they are built, naming the
field: before, a head count of 0 raised a bare ZeroDivisionError, an attention dropout of
1.5 built and failed only at the first training step, ``n_inner=0`` silently became
``4 * n_embd``, and XLNet took a negative ``mem_len`` / ``reuse_len``, which its memory
update and its K/V reuse read two ways (results differed with ``reuse_kv``)."""
import pytest

from ctxfast.models.bert import BertConfig
from ctxfast.models.gpt import GPTConfig
from ctxfast.models.xlnet import XLNetConfig

BAD = [
    (GPTConfig, "n_head", 0), (GPTConfig, "n_head", -2), (GPTConfig, "n_embd", 0),
    (GPTConfig, "vocab_size", 0), (GPTConfig, "n_positions", 0), (GPTConfig, "n_layer", -1),
    (GPTConfig, "n_inner", 0), (GPTConfig, "attn_dropout", 1.5),
    (GPTConfig, "attn_dropout", 1.0), (GPTConfig, "dropout", -0.1),
    (GPTConfig, "embd_dropout", 2.0), (GPTConfig, "n_head", 2.0),
    (BertConfig, "n_head", 0), (BertConfig, "type_vocab_size", 0),
    (BertConfig, "n_inner", 0), (BertConfig, "attn_dropout", 1.0),
    (BertConfig, "dropout", 1.2),
    (XLNetConfig, "mem_len", -1), (XLNetConfig, "reuse_len", -1),
    (XLNetConfig, "dropout", 1.0),
]


@pytest.mark.parametrize("cls, field, value", BAD,
                         ids=[f"{c.__name__}-{f}={v}" for c, f, v in BAD])
def test_bad_field_is_refused_by_name(cls, field, value):
    small = dict(n_head=2, n_embd=8) if cls is not XLNetConfig else dict(n_head=2, d_model=8)
    with pytest.raises(ValueError, match=f"{cls.__name__}[.:] ?{field}"):
        cls(**{**small, field: value})


@pytest.mark.parametrize("cls", [GPTConfig, BertConfig])
def test_head_count_must_divide_the_width(cls):
    with pytest.raises(ValueError, match="divisible by n_head"):
        cls(n_head=3, n_embd=8)


def test_good_values_pass():
    GPTConfig(n_head=2, n_embd=8, n_inner=None, n_layer=0, attn_dropout=0.0, dropout=1.0)
    BertConfig(n_head=2, n_embd=8, n_inner=5)
    XLNetConfig(n_head=2, d_model=8, mem_len=None, reuse_len=0)
    XLNetConfig(n_head=2, d_model=8, mem_len=0)
