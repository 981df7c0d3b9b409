"""Reference model definitions (GPT, BERT, ELMo, AWD-LSTM, Transformer-XL, XLNet), each
taking ``backend="ctxfast" | "eager"``. None yet: see issue 6."""
__all__: list = []

from .gpt import GPT, GPTConfig  # noqa: E402
from .bert import Bert, BertConfig, BertOutput  # noqa: E402
from .hf import from_hf  # noqa: E402
__all__ += ["GPT", "GPTConfig", "Bert", "BertConfig", "BertOutput", "from_hf"]
from .xlnet import XLNetConfig, XLNetLMHeadModel, XLNetModel, from_hf_xlnet  # noqa: E402
__all__ += ["XLNetConfig", "XLNetModel", "XLNetLMHeadModel", "from_hf_xlnet"]
from .transformer_xl import TransformerXL, TransformerXLConfig  # noqa: E402
__all__ += ["TransformerXL", "TransformerXLConfig"]
from .awd_lstm import AWDLSTM, AWDLSTMClassifier, AWDLSTMConfig, AWDLSTMLM  # noqa: E402
__all__ += ["AWDLSTM", "AWDLSTMClassifier", "AWDLSTMConfig", "AWDLSTMLM"]
from .elmo import Elmo, ElmoBiLM, ElmoConfig, ScalarMix, batch_to_ids  # noqa: E402
__all__ += ["Elmo", "ElmoBiLM", "ElmoConfig", "ScalarMix", "batch_to_ids"]
