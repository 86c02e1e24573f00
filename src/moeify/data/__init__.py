"""moeify.data: corpora (fetch, verify, cache, split), tokenisers, token streams for XL training.

    corpus = load_corpus("wiki-excerpt")            # or shakespeare, enwik8, a local path, ...
    tok = build_tokenizer("byte", corpus)           # byte256, sentencepiece, gpt2
    train = tokenize_split(corpus, tok, "train")    # memory-mapped uint16/uint32 tokens
    batches = StreamBatcher(train, batch_size=8, seq_len=256, rank=0, world_size=1)
    x_BT1 = batches.next()                          # [B, T+1], contiguous across steps
"""

from moeify.data.cache import cache_dir
from moeify.data.corpora import CORPORA, SPLITS, Corpus, list_corpora, load_corpus, register_corpus
from moeify.data import listops  # noqa: F401,E402  registers the generated "listops" corpus
from moeify.data.stream import StreamBatcher, token_dtype, tokenize_split
from moeify.data.tokenizers import (
    TOKENIZER_KINDS,
    ByteTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    build_tokenizer,
    load_tokenizer,
    train_sentencepiece,
)


def __getattr__(name: str):
    # GPT-2 BPE builds its Unicode classes on import (about a second): load it on demand.
    if name == "GPT2Tokenizer":
        from moeify.data.gpt2_bpe import GPT2Tokenizer

        return GPT2Tokenizer
    raise AttributeError(name)


__all__ = ["CORPORA", "SPLITS", "TOKENIZER_KINDS", "ByteTokenizer", "Corpus", "GPT2Tokenizer",
           "SentencePieceTokenizer", "StreamBatcher", "Tokenizer", "build_tokenizer", "cache_dir",
           "list_corpora", "load_corpus", "load_tokenizer", "register_corpus", "token_dtype",
           "tokenize_split", "train_sentencepiece"]
