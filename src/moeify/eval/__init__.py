"""moeify.eval: perplexity / bits per character and the zero-shot tasks (LAMBADA, BLiMP, CBT),
scored as the SwitchHead authors scored them, through a callable ``logits_fn(ids_BT) ->
logits_BTV``."""

from moeify.eval.blimp import BlimpPair, blimp_accuracy, load_blimp
from moeify.eval.cbt import CBT_GROUPS, CBTExample, cbt_accuracy, load_cbt, parse_cbt
from moeify.eval.lambada import lambada_accuracy, load_lambada
from moeify.eval.paths import locate
from moeify.eval.perplexity import perplexity, perplexity_of_text
from moeify.eval.scoring import ContinuationScore, score_continuations

__all__ = ["BlimpPair", "CBTExample", "CBT_GROUPS", "ContinuationScore", "blimp_accuracy",
           "cbt_accuracy", "lambada_accuracy", "load_blimp", "load_cbt", "load_lambada", "locate",
           "parse_cbt", "perplexity", "perplexity_of_text", "score_continuations"]
