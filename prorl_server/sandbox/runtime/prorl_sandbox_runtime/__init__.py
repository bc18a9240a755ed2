"""The program that runs inside a sandbox: the runtime and its judging harness.

Stdlib only, for the sandbox image's own python3 (3.8 and newer). It is staged
read-only into each container beside its two entry scripts (prorl_runtime.py,
prorl_judge.py), which put that folder first on sys.path and import this
package by its own distinctive name before anything else. Every module uses
relative imports only, so the server imports the same files as
`prorl_server.sandbox.runtime.prorl_sandbox_runtime` (the frame codec and the
operation names, `wire`, are the server's too).

Nothing is imported here: the runtime, its Python worker and the judge each load
only what they run.
"""
