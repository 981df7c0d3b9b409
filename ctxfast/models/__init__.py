"""Reference model definitions (GPT, BERT, ELMo, AWD-LSTM, Transformer-XL, XLNet), each
taking ``backend="ctxfast" | "eager"``. None yet: see issue 6."""
__all__: list = []
