"""Tiny transformers models saved as Hugging Face folders, and the batch mixprec trains on first."""

import torch

from mixprec.data.corpus import load_corpus
from mixprec.data.loader import TrainLoader
from mixprec.data.tokenizer import ByteTokenizer


def save_tiny(folder, model_type: str = "llama", **overrides):
    """A randomly initialised transformers causal LM of vocabulary 256, saved to `folder`."""
    import transformers

    fields = dict(vocab_size=256, max_position_embeddings=128)
    if model_type == "gpt2":
        # no dropout: the trainer's first step runs in training mode, the reference in eval mode
        fields.update(n_embd=64, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=None, eos_token_id=None)
    else:
        fields.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, rms_norm_eps=1e-5)
    config = transformers.AutoConfig.for_model(model_type, **{**fields, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(folder, max_shard_size=overrides.pop("_shard", "5GB"))
    return model


def first_batch(source, seq_len: int = 32, batch: int = 4, seed: int = 0):
    """The (tokens, targets) mixprec's first step trains on with the byte tokenizer."""
    tokens = ByteTokenizer().encode(load_corpus(str(source), 0.05).train)
    return TrainLoader(tokens, seq_len, batch, seed).next_batch()


def hf_loss(model, batch) -> float:
    x, y = batch
    with torch.no_grad():
        logits = model(input_ids=x).logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
