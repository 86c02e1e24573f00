"""moeify: Mixture-of-Experts everywhere inside a Transformer.

Layers (SwitchHead, MoA, sigma-MoE, Switch, Mixture-of-Depths, MoDE), the language models and
paper presets built from them, and the tools around them: training, evaluation, cost
accounting, benchmarks and plots. See README.md.
"""

__version__ = "0.1.0"

