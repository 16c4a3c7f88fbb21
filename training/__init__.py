"""Training for the serving runtime, kept out of its request path: the EAGLE draft head trainer
(``phloem train-eagle``, :mod:`phloem.training.eagle_head`) and its prompt mix."""
