"""Local ranks as processes: launch N of them by module entry point (as torchrun does), let each die with its
launcher, supervise them against a deadline, and kill and reap every one, whatever fails.

`rank` is the rank's side (imported before torch), `launcher` the launcher's, `functions` runs a module-level
function on N ranks, `rundir` keeps run directories under one per-user directory. Nothing here imports torch.
"""
