"""The stored formats: one class per way a weight is written into an ONNX file.

`base` says what a format provides; `floats`, `codes` (with `integer` and `fp8`),
`sign` and `split` are the built-in ones; `tiers.registry` names their tiers.
"""
