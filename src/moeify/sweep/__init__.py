"""moeify.sweep: training many runs side by side, one child process per run, for ``moeify
compare`` and ``moeify sweep`` (which only parse arguments and call this package).

    protocol    what a parent and a child share: the files in a run directory (the spec, the
                child's result, its log), the spec itself, one-line failures
    scheduler   the parent: runs children ``jobs`` at a time, progress and ETA, stopping them
                on Ctrl-C; deciding whether a run directory is trained, resumed or reused
    child       the child: trains (or resumes) one run, scores it, writes its result
                (``python -m moeify.sweep.child --child SPEC``)
    compare     ``moeify compare``: several presets, identical training, one results table
    table       ``moeify sweep``'s tables and plots over every finished run of an OUT

It sits above train, eval and analysis (a child trains with moeify.train and scores with
moeify.eval; the tables are moeify.analysis's) and below cli.
"""
