"""Tensor parallelism that serves and never hangs: rank processes, the failure channel, the step broadcast.

Layers, following the data (each module imports only from below it):
- votes: the collective helpers every rank runs to agree (gather, gather_errors, describe, is_consequence);
  below the profiler, which votes with them.
- channel: the failure records in the TCPStore, this rank's guard and watchdog, the guarded runner.
- broadcast: serving's step broadcast (rank 0 ships each step, the others run it).
The launcher, autoprofile.launch (the parent: rank processes, the backstop, and the entries `autoprofile
profile|serve --tp N`), sits outside this package at the CLI's level: it imports the profiler and the server.
This package's __init__ imports none of these modules.

Processes and groups. The launcher (the parent) hosts the TCPStore, so it outlives every rank, and spawns one
process per rank (NCCL_NVLS_ENABLE=0 and TORCH_NCCL_ASYNC_ERROR_HANDLING=0 in their environment). A rank
joins two groups:
- control: the default process group, gloo. Every decision goes over it: the profiler's MIN and votes,
  the serving step broadcast and the step's error vote. Its waits are unbounded by design: whoever a rank
  waits for there will either vote (every failure below ends in a vote) or has died, and gloo raises at
  once when a peer process is gone (its sockets close).
- data: NCCL on GPUs, gloo on CPU, used only by the model's TP layers. This is where a rank blocks
  forever when a peer raised inside a forward (measured: > 200 s in an NCCL all-reduce on 2xH200).

Bounded failure, in three parts:
1. Report before waiting. Whatever a rank runs between two votes that touches the data group (build,
   each stress, each serving step) runs in `RankGuard.section`; an exception there (and any failure the
   profiler catches, through its `on_error` hook) is posted to the store at once, before the rank goes
   on to the vote. A rank that dies outside the profiler posts from its top-level handler; a killed one
   is posted by the parent, which sees its exit code.
2. The watchdog. A thread on each rank polls the store every POLL_S. When a peer posted a failure and
   this rank is still inside a section GRACE_S later, it can only be waiting for that peer in the data
   group, so the watchdog aborts the data plane: NCCL: `ProcessGroupNCCL.abort()` (ncclCommAbort: the
   kernels poll the abort flag and return, so the host's stream sync returns); gloo: abort() does not
   free a pending operation (measured, torch 2.13), so the TP layers wait on gloo work in WAIT_SLICE
   slices and raise PeerFailed once the watchdog marked the data plane aborted. The section then raises
   PeerFailed (an aborted step's numbers are garbage and are never returned) and the rank votes.
2b. When the abort does not free it. Measured on 2xH200 (torch 2.11, NCCL of its wheel): with the abort
   called under the guard's lock, no rank waiting on a running all-reduce was freed (killed by the
   backstop 60 s later). On its own thread, the abort freed ranks waiting in decode (back in 80 ms: every
   rank retried) and in graph capture, but not one waiting in a prefill; ncclCommAbort is known to hang
   in such states. So a rank still in its section STUCK_S after the abort gives up:
   it reports its peers' diagnostic as its outcome and exits (only a process exit reclaims a GPU
   with a wedged kernel). Its peers, waiting at the vote, see it gone and end with the same text.
   Retrying after such a failure would need a rank that can still run, so it is a diagnostic, not a
   retry: the text names the rank and the error that started it.
3. The vote. Every section is followed by an all_ok on the control group (the profiler's votes; the
   serving step's error vote) and the errors are gathered from every rank, so every rank ends with the
   same text. If any rank aborted its data plane, the next build replaces it on every rank (`heal`,
   collective): the profiler shrinks and retries after an OOM inside a forward. In serving a step that
   aborted is fatal (the captured graphs hold the old communicator): every rank stops with one text.
Backstop: the parent kills ranks that have not ended BOUND_S after an unresolved failure (a rank stuck
where Python cannot run, a collective outside every section) and reports the stored records.

Why not timeouts alone: a timeout on the data group bounds the wait, but it must exceed every legitimate
skew between ranks (weight loading, cold Triton compiles: 22 s measured), so it reacts at the wrong
scale, and NCCL's own watchdog ends the process after 10 minutes with an abort, not our diagnostic. The
store and the watchdog react to the failure itself, in about GRACE_S.
"""
