"""Weight formats: how a linear weight is stored and multiplied, one class per format.

| `--dtype`            | class (instances)                          | file        | product                            |
|----------------------|--------------------------------------------|-------------|------------------------------------|
| float32, bfloat16    | `Floating` (`FLOATING`, `FLOATING_PACKED`) | floating.py | F.linear / oneDNN's prepacked copy |
| int8, int4's LM head | `Int8` (`INT8_HSPEC`, `INT8_TORCH`)        | int8.py     | hspec::int8_linear / aten's        |
| int4                 | `Int4` (`INT4_HSPEC`, `INT4_TORCH`)        | int4.py     | hspec::int4_linear / aten's        |
| w4a8, decoder layers | `W4A8` (`W4A8_FORMAT`)                     | w4a8.py     | hspec::w4a8_linear                 |
| w4a8, LM head        | `W8A8` (`W8A8_FORMAT`)                     | w4a8.py     | hspec::w8a8_linear                 |

`base.py` holds what they share (the row blocking that keeps a row's bits, a prompt's product);
`store.py` is the one place that picks a weight's format, at load (`store_target_weights`). The kernels
named hspec::* are in models/cpu_kernels.cpp; the native decoder stack (models/decoder_stack.cpp) makes
the same products from the same tensors.
"""
