"""GGUF -> mlx-lm model directory, in steps (gguf_import.py runs them in this order):

reader.py        open the file with llama.cpp's own `gguf` reader, refuse unknown tensor types
architectures.py one entry per architecture: tensor names, hyperparameters, value transforms
                 (configs.py builds the config.json of each; rope_scaling.py recovers Llama 3's)
tokenizer.py     the Hugging Face tokenizer from the vocabulary in the metadata (transformers' builders)
weights.py       dequantize, transform, cast or re-quantize, write safetensors shards
"""
