"""The HSTU layer stack over jagged sequences: :mod:`.jagged` (jagged <-> padded), :mod:`.attention`
(the pointwise attention, plain PyTorch or FBGEMM's fused kernel) and :mod:`.layer` (the layer)."""
