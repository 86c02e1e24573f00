"""moeify: Mixture-of-Experts everywhere inside a Transformer.

Layers (SwitchHead, MoA, MoH, MoSA, sigma-MoE, Switch, ReMoE, Mixture-of-Depths, MoDE,
Mixture-of-Recursions, MoEUT), the language models and paper presets built from them, and the
tools around them: training, evaluation, cost accounting, benchmarks and plots. README.md leads
in; the documentation site is built from docs/ (mkdocs.yml).
"""

__version__ = "0.1.0"

