"""Drop-in nn.Modules built on ctxfast ops (attention and LSTM layers).

None yet: the attention (issue 3), relative attention (issue 4) and weight-dropped LSTM
(issue 5) modules land here.
"""
__all__: list = []
