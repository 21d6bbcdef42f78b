"""What the test modules share; a test module imports these, never another test module.

- `distributed`: a function run on N real processes joined by a gloo (or NCCL) process group.
"""
