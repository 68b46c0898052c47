"""`asynctp demo`: a Llama-style model trained with vanilla tensor parallelism and with asynctp."""
