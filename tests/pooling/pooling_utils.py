"""Tiny pooling checkpoints (sentence-transformers embedders, sequence classifiers) and their oracles.

Every builder saves a seeded random transformers model with the tests' in-process tokenizer (its chat template
removed: sentence-transformers would otherwise format each text as a chat message). The oracles are
sentence-transformers (embedders) and transformers (classifiers), float32 on CPU, one text at a time.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.utils import _tiny_config, train_tiny_tokenizer

# Texts of mixed lengths (a few tokens to ~60), so a small token budget needs several steps.
TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "What is the capital of France? The capital of France is Paris. " * 2,
    "def fibonacci(n: int) -> int:",
    "The cat was happy, and the two of them counted the stars together every night.",
]


def _tokenizer(pair_type_ids: bool = False):
    """The tests' tokenizer without its chat template; ``pair_type_ids``: a text pair's second text gets segment
    id 1 (as BERT's ``[CLS] A [SEP] B [SEP]``), so ``token_type_ids`` matter."""
    tokenizer = train_tiny_tokenizer()
    tokenizer.chat_template = None
    if pair_type_ids:
        from tokenizers import processors
        from transformers import PreTrainedTokenizerFast

        backend = tokenizer.backend_tokenizer
        bos, eos = tokenizer.bos_token, tokenizer.eos_token
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}",
            pair=f"{bos} $A {eos} $B:1 {eos}:1",
            special_tokens=[(bos, tokenizer.bos_token_id), (eos, tokenizer.eos_token_id)],
        )
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token=bos,
            eos_token=eos,
            pad_token=tokenizer.pad_token,
            model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        )
    return tokenizer


def _encoder_config(arch: str, tokenizer, **overrides):
    from transformers import BertConfig, XLMRobertaConfig

    cls = {"bert": BertConfig, "xlm-roberta": XLMRobertaConfig}[arch]
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        type_vocab_size=2 if arch == "bert" else 1,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights larger than transformers' init: norm weights around 1, the rest std 0.15 (0.1 biases)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "LayerNorm.weight")):
                offset, std = 1.0, 0.1
            elif name.endswith(".bias"):
                offset, std = 0.0, 0.1
            else:
                offset, std = 0.0, 0.15
            param.copy_(offset + std * torch.randn(param.shape, generator=gen))


def _config(arch: str, tokenizer, **overrides):
    if arch in ("bert", "xlm-roberta"):
        return _encoder_config(arch, tokenizer, **overrides)
    return _tiny_config(
        arch,
        len(tokenizer),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        **overrides,
    )


def save_base_model(arch: str, path: str | Path, **overrides) -> str:
    """A bare encoder / decoder body (``BertModel``, ``XLMRobertaModel``, ``Qwen3Model``...) and the tokenizer."""
    from transformers import AutoModel

    tokenizer = _tokenizer()
    config = _config(arch, tokenizer, **overrides)
    model = AutoModel.from_config(config, dtype=torch.float32)
    _randomize(model, sum(arch.encode()))
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def make_st_embedder(
    arch: str, path: str | Path, pooling_mode: str, normalize: bool = True, **overrides
) -> str:
    """A sentence-transformers checkpoint: Transformer(``arch`` body) + Pooling(``pooling_mode``: cls, mean,
    lasttoken) [+ Normalize]."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    path = Path(path)
    base = save_base_model(arch, path / "hf", **overrides)
    transformer = Transformer(base)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(path / "st"))
    return str(path / "st")


def make_classifier(
    arch: str, path: str | Path, num_labels: int = 1, pair_type_ids: bool = False, **overrides
) -> str:
    """A ``*ForSequenceClassification`` checkpoint (``arch``: xlm-roberta, bert, qwen3, llama); ``pair_type_ids``:
    its tokenizer gives a pair's second text segment id 1 (a BERT cross-encoder's)."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = _tokenizer(pair_type_ids)
    config = _config(arch, tokenizer, num_labels=num_labels, **overrides)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    _randomize(model, sum(arch.encode()) + num_labels)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@torch.inference_mode()
def st_embed_ref(path: str, texts: list[str]) -> torch.Tensor:
    """sentence-transformers' embeddings, one text at a time: [len(texts), dim] float32."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    return torch.stack([model.encode(t, convert_to_tensor=True).float() for t in texts])


@torch.inference_mode()
def hf_classifier_logits(path: str, texts: list[str], pairs: list[str] | None = None) -> torch.Tensor:
    """transformers' sequence-classification logits, one input (text, or text pair) at a time: [N, num_labels]."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for i, text in enumerate(texts):
        enc = (
            tokenizer(text, pairs[i], return_tensors="pt") if pairs else tokenizer(text, return_tensors="pt")
        )
        rows.append(model(**enc).logits[0].float())
    return torch.stack(rows)


@torch.inference_mode()
def hf_last_hidden(path: str, texts: list[str], pooling: str) -> torch.Tensor:
    """transformers' final hidden states of a causal LM (or base model), pooled (cls / mean / last): [N, H]."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for text in texts:
        hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]  # [len, H]
        rows.append({"cls": hidden[0], "mean": hidden.mean(0), "last": hidden[-1]}[pooling])
    return torch.stack(rows)


def assert_close(ours: torch.Tensor, ref: torch.Tensor, atol: float = 1e-5) -> None:
    """Row-wise cosine >= 0.99999 and every value within ``atol``."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    cos = torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=-1)
    assert cos.min().item() >= 0.99999, cos
    assert (ours - ref).abs().max().item() <= atol, (ours - ref).abs().max()
