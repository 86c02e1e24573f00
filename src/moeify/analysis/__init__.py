"""moeify.analysis: pictures and comparisons of trained runs. Reads run directories (model.json,
config.json, metrics.jsonl, checkpoints) and never imports moeify.train.

    attention_maps   per-head attention maps with SwitchHead's expert selections, entropy
    experts          expert usage per layer for every kind of routing
    curves           training / validation curves against tokens and training time
    compare          results of several runs: cost, quality, ordering and its stability
    plotting         lazy matplotlib and PNGs that list their panels

Run directories are read through moeify.rundir.
"""
