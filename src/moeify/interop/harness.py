"""lm-evaluation-harness model type ``moeify``: a moeify run scored by the harness.

    import moeify.interop.harness                       # registers the model type "moeify"
    lm_eval.simple_evaluate(model="moeify", model_args="run=RUN_DIR,batch_size=8,device=cpu",
                            tasks=[...], task_manager=local_task_manager())

Every request goes through moeify's own zero-shot scorer (moeify.eval.scoring), so the harness
and ``moeify eval`` score an item identically:

- loglikelihood: ``(context, continuation)`` is tokenised as two parts, context then
  continuation (whitespace at the end of the context moves to the continuation, as the harness's
  own models do), batched by length and right-padded with the padding mask passed to the model.
  ``is_greedy`` is true when the argmax at every continuation position is the continuation's
  token. Inputs longer than the model's zero-shot context (its context length, twice that for XL
  models, which attend over one chunk of memory) lose tokens from the left of the context, as
  in ``moeify eval --task lambada``; a continuation longer than that context on its own is
  scored whole, as ``moeify eval --task blimp`` scores every sentence.
- An empty context: moeify's tokenisers have no beginning-of-text token, so the first token of
  the continuation is the context and the remaining tokens are scored. This is how moeify scores
  BLiMP sentences (all tokens after the first); the harness's Hugging Face model instead prepends
  its end-of-text token and scores every token.
- loglikelihood_rolling: the harness's rolling windows (lm_eval.utils.get_rolling_token_windows,
  one token of overlap, the last window with full context) over the document's tokens after the
  first, each window scored without XL memory; the document's value is the sum.
- generate_until: moeify.eval.generate with the KV cache, one request at a time, greedy unless
  the request asks for sampling; generation stops once the decoded text contains one of the
  ``until`` strings and the text is cut before it.

The tokeniser is the run's own (tokenizer.json in the run directory; bytes for the tiny presets).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from moeify.errors import MoeifyError, install_hint, read_utf8
from moeify.eval.generate import generate
from moeify.eval.adapters import stateless_logits_fn
from moeify.eval.scoring import score_continuations, zero_shot_context
from moeify.rundir import load_trained

try:
    import lm_eval.models  # noqa: F401  (registers lm-eval's own model names before ours)
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:
    raise MoeifyError("the lm-evaluation-harness integration needs lm-eval: "
                      + install_hint("harness")) from None

TASKS_DIR = Path(__file__).with_name("harness_tasks")
AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def split_request(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(prefix ids, continuation ids) of a loglikelihood request (see the module docstring)."""
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    prefix = tokenizer.encode(stripped) if stripped else []
    cont = tokenizer.encode(continuation) if continuation else []
    if not prefix:
        if len(cont) < 2:
            raise MoeifyError(f"cannot score {continuation!r} without a context: the model has no "
                              "beginning-of-text token, so a request with an empty context "
                              "needs a continuation of at least two tokens")
        prefix, cont = cont[:1], cont[1:]
    if not cont:
        raise MoeifyError(f"the continuation of the request with context {context[-40:]!r} is "
                          "empty: nothing to score")
    return prefix, cont


def _positive_int(name: str, value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or str(value).strip() != str(n):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return n


@register_model("moeify")
class MoeifyLM(LM):
    """A moeify run as an lm-eval ``LM``. model_args: ``run`` (the run directory: its latest
    checkpoint is loaded), ``batch_size`` (default 8), ``device`` (default cpu), ``amp``
    (fp32, bf16 or fp16; default fp32)."""

    def __init__(self, run: str | None = None, batch_size: int | str = 8, device: str = "cpu",
                 amp: str = "fp32", max_batch_size: Any = None) -> None:
        # max_batch_size: lm-eval passes it to every model type; batches here are batch_size
        super().__init__()
        if run is None:
            raise ValueError("the moeify model type needs model_args run=RUN_DIR")
        if amp not in AMP_DTYPES:
            raise ValueError(f"amp must be one of {', '.join(AMP_DTYPES)}, got {amp!r}")
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ValueError(f"device {device!r} is not a torch device (cpu, cuda, cuda:N)"
                             ) from None
        loaded = load_trained(run, dev)
        self._setup(loaded.model, loaded.tokenizer, dev, AMP_DTYPES[amp],
                    _positive_int("batch_size", batch_size))

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer, *, device: torch.device,
                   amp_dtype: torch.dtype | None = None, batch_size: int = 8) -> "MoeifyLM":
        """The adapter around a model already loaded (as ``moeify eval`` loads it)."""
        self = cls.__new__(cls)
        LM.__init__(self)
        self._setup(model, tokenizer, device, amp_dtype, _positive_int("batch_size", batch_size))
        return self

    def _setup(self, model, tokenizer, device, amp_dtype, batch_size: int) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._device = torch.device(device)
        self.batch_size = batch_size
        self.max_len = zero_shot_context(model.config)
        self.logits_fn = stateless_logits_fn(model, self._device, amp_dtype)
        # progress(label, done, total): told after each scored batch or generated request (a
        # display; moeify eval --harness sets it). None: silent.
        self.progress = None

    def _report(self, label: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(label, done, total)

    # ------------------------------------------------------------------ requests
    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        items = [split_request(self.tokenizer, *r.args[:2]) for r in requests]
        scores = self._score(items, greedy=True)
        out = []
        for r, (_, cont), s in zip(requests, items, scores):
            res = (s.total, s.greedy == list(cont))
            self.cache_hook.add_partial("loglikelihood", r.args, res)
            out.append(res)
        return out

    def _score(self, items: list, greedy: bool = False) -> list:
        """moeify's scorer over ``items``: inputs longer than the zero-shot context lose context
        tokens from the left; an item whose continuation alone is longer is scored whole (as
        ``moeify eval`` scores BLiMP sentences, whatever their length)."""
        fits = [len(cont) <= self.max_len for _, cont in items]
        out: list = [None] * len(items)
        done = 0
        for ok in (True, False):
            idx = [i for i, f in enumerate(fits) if f == ok]
            if idx:
                scores = score_continuations(
                    self.logits_fn, [items[i] for i in idx], batch_size=self.batch_size,
                    greedy=greedy, max_len=self.max_len if ok else None,
                    progress=lambda d, _t, base=done: self._report("log-likelihoods",
                                                                   base + d, len(items)))
                done += len(idx)
                for i, s in zip(idx, scores):
                    out[i] = s
        return out

    def rolling_items(self, text: str) -> list[tuple[list[int], list[int]]]:
        """The (prefix, continuation) windows that score ``text`` (every token after the first
        exactly once, no window longer than the model's zero-shot context)."""
        ids = self.tokenizer.encode(text)
        if len(ids) < 2:
            return []
        windows = lm_utils.get_rolling_token_windows(token_list=ids[1:], prefix_token=ids[0],
                                                     max_seq_len=self.max_len, context_len=1)
        return [tuple(map(list, lm_utils.make_disjoint_window(w))) for w in windows]

    def loglikelihood_rolling(self, requests: Sequence[Any]) -> list[float]:
        per_doc = [self.rolling_items(r.args[0]) for r in requests]
        flat = [item for items in per_doc for item in items]
        scores = self._score(flat) if flat else []
        out, start = [], 0
        for r, items in zip(requests, per_doc):
            total = sum(s.total for s in scores[start:start + len(items)])
            start += len(items)
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
            out.append(total)
        return out

    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        out = []
        for n, r in enumerate(requests, 1):
            context, gen_kwargs = r.args[0], dict(r.args[1] or {})
            text = self.generate_one(context, **gen_kwargs)
            self.cache_hook.add_partial("generate_until", r.args, text)
            out.append(text)
            self._report("generations", n, len(requests))
        return out

    def generate_one(self, context: str, *, until: str | Sequence[str] | None = None,
                     max_gen_toks: int = 256, do_sample: bool = False,
                     temperature: float | None = None, top_k: int | None = None,
                     top_p: float | None = None, **_ignored: Any) -> str:
        """The continuation of ``context``, cut before the first ``until`` string. Generation
        kwargs other than these are ignored."""
        stops = [until] if isinstance(until, str) else [s for s in (until or []) if s]
        prompt = self.tokenizer.encode(context)
        if not prompt:
            raise MoeifyError("generate_until got an empty context: give at least one token")
        decode = self.tokenizer.decode
        temp = (1.0 if temperature is None else float(temperature)) if do_sample else 0.0
        new = generate(self.model, prompt, max_new_tokens=int(max_gen_toks), temperature=temp,
                       top_k=top_k, top_p=top_p, window=self.max_len,
                       should_stop=(lambda ids: any(s in decode(ids) for s in stops))
                       if stops else None)
        text = decode(new)
        cut = min((text.index(s) for s in stops if s in text), default=len(text))
        return text[:cut]


def task_dirs(include: Sequence[str | Path] = ()) -> list[str]:
    """moeify's bundled local task definitions, then the user's directories (which may override
    a bundled task of the same name)."""
    dirs = [TASKS_DIR, *(Path(p).expanduser() for p in include)]
    for d in dirs[1:]:
        if not d.is_dir():
            raise MoeifyError(f"harness task directory {d} does not exist: give a directory of "
                              "lm-eval task YAML files")
        check_task_yaml(d)
    return [str(d) for d in dirs]


def check_task_yaml(directory: Path) -> None:
    """Every YAML file under a user's task directory parses: lm-eval skips a broken one with a
    log line, and its task is then reported as unknown, far from the cause."""
    import yaml  # lm-eval's dependency: present only with the harness extra

    class Loader(yaml.SafeLoader):
        pass

    # lm-eval's own tags (!function utils.NAME) need its loader; here only the syntax counts.
    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    for path in sorted(directory.rglob("*.yaml")) + sorted(directory.rglob("*.yml")):
        try:
            yaml.load(read_utf8(path), Loader=Loader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise MoeifyError(f"{where}: the task file is not valid YAML ({what}); fix it or "
                              "move it out of the --harness-include directory") from None


def local_task_manager(include: Sequence[str | Path] = ()):
    """An lm-eval TaskManager over the local task definitions only (lm-eval's own tasks fetch
    their data from the Hugging Face hub, which an offline evaluation cannot reach)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=task_dirs(include), include_defaults=False)
