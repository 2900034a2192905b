"""The rule table: each rule reads typed `Evidence` and says what it saw (a `Hit`) or nothing.

Precedence is the table's order (see docs/failures.md for the table and the reasons behind it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from trainer import EXIT_CONFIG_ERROR, EXIT_PREEMPTED
from trainer import failure_catalogue as catalogue
from operators.failures.evidence import (
    LAUNCHER_EXIT,
    MPIRUN_SIGNAL,
    RANK_PREFIX,
    SIGNAL_NAMES,
    Evidence,
    Exc,
    parse_exception_line,
)

Kind = Literal["infra", "user", "unknown"]
_RANK_IN_LINE = re.compile(r"\[(?:rank|Rank|RANK)\s*(\d+)\]|\bRank (\d+)\b")



def _rx(*patterns: str) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)


# Hardware Xids (NVIDIA's Xid catalogue): 13/31/43/45 are usually the application's own fault
# (illegal address, MMU fault, stopped/cleaned-up channel) and are not decisive on their own.
_XID = re.compile(r"NVRM: Xid \([^)]*\):\s*(\d+)", re.IGNORECASE)
_APP_XIDS = {13, 31, 43, 45}
_GPU_HARDWARE = catalogue.GPU_HARDWARE
_COLLECTIVE_TIMEOUT = catalogue.COLLECTIVE_TIMEOUT
_PEER_LOST = catalogue.PEER_LOST
_RENDEZVOUS = catalogue.RENDEZVOUS
_STORAGE = catalogue.STORAGE
_NETWORK = catalogue.NETWORK
# A node (or a framework's worker host) died or was removed under the job.
_NODE_GONE = _rx(
    r"has been marked dead because the detector has missed too many heartbeats", r"marked as dead by the GCS",
    r"\bRAYLET_MARKED_DEAD\b", r"\bNodeDiedError\b", r"node (?:was |has been )?(?:removed|deleted|terminated|drained) (?:from|by)",
    r"Terminating EC2 instance", r"Node is shutting", r"DUE TO NODE FAILURE", r"srun: error: Node failure on", r"kubelet (?:stopped|is not) posting node status",
    r"(?:worker|raylet|node) (?:died|crashed) unexpectedly", r"Shutdown manager killing pod", r"\bNodeNotReady\b",
    r"^\s*pod deleted\s*$",
    # Slurm: the node failed the job's launch (prolog, slurmd); Databricks: the node's daemon died
    r"launch failed requeued held", r"Prolog failure on node", r"PrologSlurmctld failed", r"did not answer ping",
    r"\bVMRecreatedDuringExecution\b",  # GCP Batch recreated the task's VM under it
    r"hosted runner(?::[^\n]{1,200})? lost communication with the server",  # GitHub Actions lost the job's machine
    r"The runner has received a shutdown signal",  # GitHub Actions: the runner's machine went away under the job
    # the kubelet lost the node's container runtime: every pod on the node goes with it
    r"container runtime is down", r"PLEG is not healthy", r"container runtime (?:network )?(?:is )?not ready",
)  # fmt: skip
# The node could not take the pod for now: pressure, capacity, a device plugin failing admission.
_NODE_PRESSURE = _rx(
    r"The node was low on resource", r"The node had condition: \[\w*Pressure\]", r"\b\w{1,64} are evicted\b",
    r"\bUnexpectedAdmissionError\b",
)  # fmt: skip
# The cloud has no capacity for the request right now (not a quota: that is the user's).
_NO_CAPACITY = _rx(
    r"Insufficient (?:instance )?capacity", r"\bInsufficientInstanceCapacity\b", r"Failed to acquire resources in all zones",
    r"Insufficient GPU capacity", r"\bZONE_RESOURCE_POOL_EXHAUSTED\w*", r"\bstockout\b", r"does not have enough resources available",
    r"There is no (?:more )?capacity", r"\bOutOfCapacity\b", r"capacity not available",
    # Azure ML and SageMaker's CapacityError; Colab's "no backends available"
    r"Unable to provision requested ML compute capacity", r"\bCapacityError\b", r"no backends available",
    r"provisioning additional capacity", r"\bout of capacity\b", r"Resources are insufficient in region",
    # Colab has no GPU for the account now (its words in English, Portuguese, Spanish); a Hugging Face Space's hardware
    r"Colab's usage limits", r"limites de uso do Colab", r"l[ií]mites de uso de Colab",
    r"Scheduling failure: (?:not enough hardware capacity|unable to schedule)",
)  # fmt: skip
# An account or namespace quota/limit: the request must shrink or the limit grow.
_QUOTA = _rx(
    r"\b\w{0,64}LimitExceeded\b(?<!RequestLimitExceeded)(?<!BandwidthLimitExceeded)", r"\b\w{0,64}QuotaExceeded\b(?<!downloadQuotaExceeded)", r"exceeded quota",
    r"[Qq]uota '?[\w.-]+'? exceeded", r"\bservice limit\b", r"(?:Found )?no quota for", r"out of quota",
    r"exceeds? (?:your|the) (?:current )?(?:\w+ )?(?:quota|limit)", r"limit of \d+ \w+ allows",
    r"Disk quota exceeded", r"\[Errno 122\]", r"\bEDQUOT\b",  # the user's (or group's) file-system quota
    r"Not enough quota available for",  # Azure ML's deployment of a VM size the subscription has no quota for
    # Google's APIs refusing a request past the project's quota (status RESOURCE_EXHAUSTED, as throttling is)
    r"Quota failure for project", r"quota metrics exceed quota limits",
)  # fmt: skip
# A cloud provider took the machine back (spot/preemptible capacity, maintenance).
_CLOUD_PREEMPTION = _rx(
    r"\b(?:spot|preemptible)\b[^\n]{0,80}\b(?:interrupt\w*|preempt\w*|reclaim\w*|terminat\w*)",
    r"\binstance (?:was |has been )?preempted\b",
    r"\b(?:cluster|VM|node|machine|TPU|spot \w+) (?:is|was|has been|got) preempted\b",
    r"\bpreempted by (?:the )?(?:cloud|provider|GCE|GCP|AWS|Azure|EC2)\b",
    r"\b(?:EC2 )?Spot Instance Interruption\b",
    r"\bhost maintenance\b[^\n]{0,60}\b(?:terminat\w*|migrat\w*|event)",
    # Azure ML, GCP's metadata service, Google Cloud Batch/Dataflow, AWS Batch, PBS
    r"\bPreemptionError\b", r"\bgot pre-empted\b", r"\bpre-emption warning\b", r"\bPREEMPTED_WHILE_RUNNING\b",
    r"termination is imminent", r"Host EC2 (?:\(instance [\w-]+\) )?terminated", r"\bjob preempted \(node failure\)",
)  # fmt: skip
# The API server refused the object: an admission webhook, quota, validation (the spec is wrong).
_ADMISSION_REJECTED = _rx(
    r"admission webhook \S+ denied the request",
    r"\bis forbidden: (?:exceeded quota|unable to validate against any (?:pod )?security policy|violates PodSecurity)",
    r"\bis invalid: [\w.\[\]]+: (?:Invalid value|Required value|Unsupported value|Forbidden|Too many|Too long|Duplicate value)",
    r"\bfield is immutable\b",
)  # fmt: skip
_INVALID_DEVICE = _rx(
    r"invalid device ordinal", r"CUDA error: invalid device (?:ordinal|function)", r"\bcudaErrorInvalidDevice\b",
    r"Invalid device id", r"device (?:index|ordinal) \S+ (?:is )?out of range", r"HIP error: invalid device function",
)  # fmt: skip
_CHECKPOINT_MISMATCH = _rx(
    r"Error\(s\) in loading state_dict", r"Missing key\(s\) in state_dict", r"Unexpected key\(s\) in state_dict",
    r"size mismatch for \S+: copying a param",
)  # fmt: skip
# The pod's /dev/shm is too small for the DataLoader's workers (Docker's default is 64 MiB).
_SHM_TOO_SMALL = _rx(
    r"DataLoader worker \(pid \d+\) is killed by signal: Bus error",
    r"unable to write to file </torch_\d+",
    r"insufficient shared memory \(shm\)", r"workers are out of shared memory", r"Unexpected bus error encountered in worker",
    r"No space left on device[^\n]{0,40}/dev/shm|/dev/shm[^\n]{0,80}No space left on device",
    r"NCCL[^\n]{0,80}(?:shm|shared memory)[^\n]{0,80}(?:No space left|failed)",
    # UCX (and Open MPI over it) touching a /dev/shm page the container's small shm cannot back
    r"Bus error: nonexistent physical address",
)  # fmt: skip

# The software in the image does not fit the node or itself: versions, builds, architectures.
_ENVIRONMENT = _rx(
    r"Version mismatch: The cluster was started with", r"\bMismatched [\w ]{0,40}version",
    r"Loaded runtime \w+ library: [\d.]+ but source was compiled with", r"no kernel image is available for execution",
    r"unsatisfied condition: cuda\s*>=", r"undefined symbol: \w+", r"flag provided but not defined", r"Exec format error",
    r"ninja: build stopped", r"\bld returned \d+ exit status", r"fatal error: [\w./+-]+\.h: No such file",
    r"error: command '[\w/+.-]+' failed", r"DNN library is not found", r"CUDA driver version is insufficient for CUDA runtime",
    r"GLIBC_[\d.]+' not found", r"cannot open shared object file", r"\bNo module named '?[\w.]+",
    r"is not compatible with the current PyTorch installation", r"requires? (?:a )?(?:newer|higher|more recent) version",
    r"(?:built|compiled) (?:with|against|for) [^\n]{0,60}(?:but|while) [^\n]{0,60}(?:installed|found|loaded|running)",
    r"unsupported (?:GPU|device|compute capability|architecture)", r"\bsm_\d+ is not compatible",
    # SIGILL: the binary uses CPU instructions (AVX, AVX2, AVX-512) this machine type lacks
    r"(?m:^.{0,80}\bIllegal instruction(?: \(core dumped\))?\s*$)", r"Fatal Python error: Illegal instruction",
    # GPU code built for other devices: a PTX newer than the driver's, ROCm without this GPU's target
    r"Unsupported \.version [\d.]+; current version is", r"Unable to find code object for all current devices",
    r"\bhipErrorNoBinaryForGpu\b", r"only supports Ampere GPUs or newer",
    # the CUDA runtime in the image does not fit the host's driver (803, 804), as torch reports it at start
    r"system has unsupported display driver / cuda driver combination", r"forward compatibility was attempted on non supported HW",
    r"Unexpected error from cudaGetDeviceCount\(\)[^\n]{0,200}Error 500: named symbol not found",
    r"TensileLibrary\w{0,64}\.dat: No such file or directory for GPU arch",  # rocBLAS without kernels for this GPU
    # a feature this GPU generation lacks (bf16, large FlashAttention heads, a newer compute capability)
    r"requires \.target sm_\d+ or higher", r"only supported on GPUs with compute capability of at least",
    r"requires A100 or H100", r"is not compatible with compile time compute cap",
    r"Distributed package doesn't have NCCL built in",  # a torch build without NCCL (Windows, macOS)
    r"The NVIDIA driver on your system is too old",  # torch built for a newer CUDA than the driver
)  # fmt: skip
# The runtime loaded and found no device (cudaErrorNoDevice, hipErrorNoDevice): the node's GPUs are gone or
# its driver is broken. "No CUDA GPUs are available" (nothing allocated, a CPU-only build) is _NO_GPU_VISIBLE's.
_NO_DEVICE = _rx(r"no (?:CUDA|ROCm)-capable device is detected", r"\b(?:cudaErrorNoDevice|hipErrorNoDevice|CUDA_ERROR_NO_DEVICE)\b")
# The node's GPU stack is broken: driver/library mismatch, NVML, GSP firmware, fabric manager,
# a GPU the device plugin marked unhealthy, a driver that cannot build for the node's kernel, no device.
_GPU_NODE = _rx(
    r"Failed to initialize NVML", r"\bdriver/library version mismatch", r"NVRM: API mismatch", r"could not load NVML library",
    r"Timeout waiting for RPC from GSP", r"\bGSP (?:RPC )?[Tt]imeout", r"XidCriticalError", r"device (?:marked|will go) unhealthy",
    r"caused by previous Xid", r"\bfabric ?manager\b", r"system not yet initialized", r"Could not resolve Linux kernel version",
    r"GPL-incompatible module nvidia\.ko", r"NVIDIA-SMI has failed", r"No devices were found", r"RmInitAdapter failed",
    r"Unable to determine the device handle for GPU", r"nvidia-container-cli: initialization error",
    r"nvls\.cc[^\n]*(?:Cuda failure|failed)",
    # CUDA's unknown error (the driver's or the GPU's state), in old and current words
    r"cuda runtime error \(30\) : unknown error", r"CUDA error: unknown error", r"\bcudaErrorUnknown\b", r"\bCUDA_ERROR_UNKNOWN\b",
    _NO_DEVICE.pattern,
)  # fmt: skip
# The program broke a tensor/API contract (shapes, dtypes, devices, autograd, DDP usage).
_PROGRAM_ERROR = _rx(
    r"expected \w+ and \w+ to have the same dtype", r"Expected all tensors to be on the same device", r"shapes cannot be multiplied",
    r"\bsize mismatch\b", r"must match the size of tensor", r"Dimension out of range", r"index \d+ is out of bounds",
    r"not implemented for '\w+'", r"CUBLAS_STATUS_NOT_SUPPORTED", r"must be (?:col|row)_major", r"parameters that were not used in producing loss",
    r"Expected to mark a variable ready only once", r"does not require grad and does not have a grad_fn",
    r"modified by an inplace operation", r"Trying to backward through the graph a second time", r"got an unexpected keyword argument",
    r"missing \d+ required positional argument", r"object has no attribute", r"is not subscriptable", r"unsupported operand type",
    r"Input type \(\S+\) and weight type \(\S+\) should be the same", r"expected scalar type \w+ but found \w+",
    r"stack expects each tensor to be equal size",  # a batch of samples with different shapes (collate)
    r"Placeholder storage has not been allocated on MPS device", r"is on (?:CPU|GPU|cuda(?::\d+)?|mps), but expected it to be on",
    r"Target -?\d+ is out of bounds", r"so expected input\[[^\]\n]{1,80}\] to have \d+ channels",
    r"Expected to have finished reduction in the prior iteration", r"expected a non-empty list of Tensors",
    r"Default process group has not been initialized",
    r"\bMPI_ERR_TRUNCATE\b",  # a receive buffer smaller than the message: ranks disagree on a size
    r"Assertion `[^`'\n]{1,200}[`'] failed",  # a C/CUDA assert (a label outside the classes, an index)
)  # fmt: skip
# A disk the job writes to is full: its own checkpoints or caches (user, 10 of the base's 15) or a
# node's or runner's disk that others filled (infra, 5 of 15): retried once (context.py reads it too).
DISK_FULL = _rx(r"No space left on device", r"\bENOSPC\b", r"\[Errno 28\]")
# The launch itself is misconfigured: ports, ssh between nodes, a wrong endpoint or region.
_LAUNCH_CONFIG = _rx(
    r"Address already in use", r"\bEADDRINUSE\b",
    r"but another process is utilizing it",  # Accelerate's check of its port
    r"Duplicate GPU detected : rank \d+ and rank \d+ both on CUDA device",  # two ranks given one GPU (NCCL)
    r"Either request fewer slots for your application",  # Open MPI: more processes than the hosts' slots
    r"Permission denied \(publickey", r"Host key verification failed",
    r"PasswordAuthentication=no[^\n]*returned non-zero exit status 255", r"Too many open files", r"\bEMFILE\b",
    r"\bncclInvalidUsage\b", r"\bncclInvalidArgument\b", r"NCCL WARN Could not find", r"mismatch in collective sizes",
    # NCCL's argument check (misc/argcheck.cc) as it warns before returning ncclInvalidArgument
    r"NCCL WARN \w{1,40} : (?:\w{1,20} argument is NULL|invalid (?:root|type|redop|peer|device pointer)\b)",
    # a write where the job's configuration points, on a file system mounted read-only there
    r"Read-only file system", r"\bEROFS\b",
    # the host name resolves to Debian's loopback alias, so peers are told to dial themselves
    r"\b127\.0\.1\.1\b[^\n]{0,40}(?:Connection refused|timed out)",
)  # fmt: skip
# The job's configuration or command line is rejected before anything runs.
_CONFIG_INVALID = _rx(
    r"\b\d+ validation errors? for \w+",  # pydantic
    r"(?m:^\S{1,256}: error: (?:unrecognized arguments|argument \S+: (?:invalid|expected|ambiguous)|the following arguments are required))",
    # Slurm refuses the submission: the request names nodes, GPUs or options this cluster lacks
    r"Requested node configuration is not available", r"no longer acceptable, please",
    r"Batch job submission failed(?!: Socket timed out)",  # a timeout is the controller's (catalogue NETWORK)
    r"Invalid generic resource \(gres\) specification", r"Requested time limit is invalid", r"is not a valid node count",
    r"line must start with #! followed by the path to an interpreter", r"cli_filter plugin terminated with error",
    # a model id or folder the Hugging Face libraries cannot use as one
    r"Repo id must be in the form 'repo_name' or 'namespace/repo_name'", r"does not appear to have a file named",
    r"resource requirement has exceeded the node size",  # an Azure ML instance type larger than its nodes
    # Ray's autoscaler: no node type of the cluster could ever hold the request (not a shortage)
    r"No available node types can fulfill resource request",
    r"Reason: ClientError: ",  # SageMaker's failure class for a job its input or configuration failed
)  # fmt: skip
# The server's own certificate ran past its end date (OpenSSL, curl, Go and Node say it so): its
# owner renews it, nothing on the client changes. 4 of 4 spent hold-out cases with the wording.
_CERT_EXPIRED = _rx(r"certificate has expired")
# The client refuses the server's TLS certificate (an intercepting proxy, a private CA, missing
# CA bundle): it fails the same way until the trust configuration changes.
_TLS_CERTIFICATE = _rx(
    r"CERTIFICATE_VERIFY_FAILED", r"certificate verify failed", r"\bSSLCertVerificationError\b",
    r"self[- ]signed certificate", r"unable to get local issuer certificate", r"x509: certificate signed by unknown authority",
)  # fmt: skip
# Storage/API refused the request itself: credentials, permissions, a bucket or key that does not exist.
_REQUEST_REFUSED = _rx(
    r"The specified bucket does not exist", r"\bNoSuchBucket\b", r"\bInvalidAccessKeyId\b", r"\bSignatureDoesNotMatch\b",
    r"\bExpiredToken\b", r"\bforbidden: User\b", r"cannot (?:get|list|create|watch|patch|delete) resource", r"\b403 Forbidden\b",
    r"\(403\)\s*Reason: Forbidden", r"\bUnauthorized\b", r"\bAccessDenied(?:Exception)?\b", r"Access Denied", r"\bInvalid Credentials\b",
    r"is not authorized to perform:",  # AWS IAM: the role lacks the action (or a policy denies it)
    r"An error occurred \((?:InvalidArgument|InvalidRequest|InvalidBucketName|NoSuchKey|InvalidObjectState)\)",
    # botocore/AWS: no usable credentials, region or endpoint for this bucket (configuration)
    r"\b(?:NoCredentialsError|PartialCredentialsError|NoRegionError|ProfileNotFound)\b", r"Unable to locate credentials",
    r"You must specify a region", r"\b(?:InvalidClientTokenId|UnrecognizedClientException|AuthorizationHeaderMalformed|PermanentRedirect)\b",
    catalogue.USER_REQUEST_MESSAGE.pattern,
    r"do not have permission to access the requested resource",  # W&B: an entity or project the user named
    r"<Response \[40[13]\]>",  # requests' repr of a refused response (W&B's "permission denied (<Response [403]>)")
    r"api_key not configured",  # W&B run without a key (no wandb.login, no WANDB_API_KEY)
    r"You are trying to access a gated repo",  # the Hub: the account has not been granted the model
    r'\{"code": ?40[13], ?"message": ?"',  # an API's one-line JSON refusal (Kaggle: "You must accept this competition's rules")
)  # fmt: skip
# The data is broken: it fails the same way on every read.
_BAD_DATA = _rx(
    r"NVJPEG error", r"\bNonMatchingChecksumError\b", r"Checksums didn't match", r"image file is truncated",
    r"cannot identify image file", r"\bUnidentifiedImageError\b", r"\bDecompressionBombError\b",
    # torch.load on a truncated or half-written file (a checkpoint, downloaded weights): replace the file
    r"unexpected EOF, expected \d+ more bytes\. The file might be corrupted",
    r"DataLossError: corrupted record at \d+",  # a TFRecord file damaged where it was written
    r"PytorchStreamReader failed reading (?:zip archive|file \S+): (?:failed finding central directory|invalid header or archive is corrupted|file read failed)",
)  # fmt: skip
# Work on one rank (tokenizing, mapping, evaluating: a progress bar) before a collective timeout.
_SINGLE_RANK_WORK = _rx(r"\b\d{1,3}%\|", r"Running tokenizer", r"\bTokeniz\w+", r"\bpreprocess\w*", r"\bMap\b[^\n]{0,40}examples")

# Launcher wrappers: their traceback is torchrun's, not the cause.
_WRAPPERS = {"ChildFailedError", "SignalException", "SystemExit", "KeyboardInterrupt", "CalledProcessError"}
# Device memory exhausted, as torch, CUDA, NCCL, XLA/JAX and TensorFlow say it.
_CUDA_OOM = _rx(
    # (ray.exceptions.OutOfMemoryError is Ray's memory monitor on the host: _HOST_OOM's)
    r"CUDA out of memory", r"(?<!ray\.exceptions\.)\bOutOfMemoryError\b", r"CUDA error: out of memory", r"CUDA_ERROR_OUT_OF_MEMORY",
    r"Cuda failure '?out of memory", r"Resource exhausted: Out\s+of\s+memory", r"RESOURCE_EXHAUSTED: Out\s+of\s+memory",
    r"Out of memory while trying to allocate", r"Can't allocate \d+ bytes on device", r"\bOOM when allocating tensor",
    r"failed to allocate [\d.]+[KMG]? \(\d+ bytes\) from device",
    r"MPS backend out of memory", r"\bkIOGPUCommandBufferCallbackErrorOutOfMemory\b",  # Apple's GPU (MPS, Metal)
    # XLA on a TPU: the program does not fit the chip's memory (HBM); XLA's RESOURCE_EXHAUSTED
    # names memory then, where the same status from a cloud API is a quota or throttling
    r"Ran out of memory in memory space (?:hbm|vmem)\b", r"RESOURCE_EXHAUSTED: XLA:TPU compile permanent error",
    r"RESOURCE_EXHAUSTED: Failed to allocate request for",  # the TPU runtime, allocating a buffer on the device
)  # fmt: skip
# The kernel's OOM killer (a cgroup limit or the host's memory): the job asks for more than it has.
_HOST_OOM = _rx(
    r"invoked oom-killer", r"\bmem_cgroup_out_of_memory\b", r"Memory cgroup out of memory", r"Out of memory: Kill(?:ed)? process",
    r"\boom_kill_process\b", r"\bOOMKilled\b",
    # a DataLoader worker SIGKILLed: the kernel's OOM killer (workers x prefetch x batch exceed host RAM)
    r"DataLoader worker (?:\(pid[^)]*\) )?is killed by signal: Killed",
    # Ray's memory monitor kills the job's own workers when the node's memory runs out
    r"exceeds the memory usage threshold", r"Task was killed due to the node running low on memory",
    # Ray's object store (shared memory) full of the job's own objects
    r"\bObjectStoreFullError\b",
    # Slurm's cgroup: the job step used more memory than it requested (--mem, --mem-per-cpu)
    r"Detected \d+ oom[-_ ]kill events?", r"Exceeded job memory limit",
    # YARN's container limit (Spark on EMR, Glue, Dataproc); a Hugging Face Space's memory limit
    r"Container killed by YARN for exceeding memory limits", r"Memory limit exceeded \(\d+(?:\.\d+)?\s?[KMGT]i?B?\)",
    # C++'s allocation failure, as the runtime prints it when nothing catches it: the host's memory ran out
    r"terminate called after throwing an instance of 'std::bad_alloc'",
    r"Unable to allocate [\d.]+ [KMGTP]i?B for an array with shape",  # numpy's MemoryError
    r"DefaultCPUAllocator: not enough memory", r"killed by the cgroup out-of-memory handler",
    r"Your session crashed after using all available RAM",  # Colab: the notebook outgrew the runtime it chose
)  # fmt: skip
_IMPORT_ERROR = re.compile(r"^(?:\[\w*\d+\]:\s*)?(ModuleNotFoundError|ImportError|SyntaxError|IndentationError|TabError)\b:?(.*)$", re.MULTILINE)  # fmt: skip
_ILLEGAL_ACCESS = _rx(
    r"CUDA error: an illegal memory access was encountered",
    r"an illegal memory access was encountered",  # cudaErrorIllegalAddress, "(77 vs. 0)", "cuda runtime error (77)"
    r"\bCUDA_ERROR_ILLEGAL_ADDRESS\b",  # the driver API's name for it (OpenMM, CuPy, Numba)
    r"CUDA error: device-side assert triggered",
    r"CUDA error: misaligned address",
    r"CUDA error: an illegal instruction was encountered",
)
_IMAGE_THROTTLED = _rx(r"toomanyrequests", r"429 Too Many Requests", r"pull rate limit", r"rate[- ]limit")
_IMAGE_MISSING = _rx(
    r"manifest unknown",
    r"not found",
    r"unauthorized",
    r"pull access denied",
    r"repository does not exist",
    r"authentication required",
    r"denied: requested access",
    r"InvalidImageName",
)
# The job sees no GPU: the resource request, CUDA_VISIBLE_DEVICES or a CPU-only build.
_NO_GPU_VISIBLE = _rx(r"No CUDA GPUs are available", r"\bno GPUs found\b", r"Found no NVIDIA driver on your system")
# NCCL (RCCL) could not set up its transport here: /dev/shm, sockets, InfiniBand libraries.
_NCCL_SYSTEM = _rx(r"\bunhandled system error\b")
# A native crash with nothing else in view (the node can cause one too: retried once, context.py).
NATIVE_CRASH = _rx(
    r"Segmentation fault", r"\bSIGSEGV\b",
    # glibc's heap-corruption aborts: memory corrupted in compiled code, as a segfault is
    r"double free or corruption", r"free\(\): invalid (?:pointer|size|next size)", r"corrupted size vs\. prev_size",
    r"malloc\(\): (?:memory corruption|corrupted top size|unaligned tcache chunk detected)",
)  # fmt: skip
# The service itself says the failure is temporary.
_CONTAINER_LIMIT = _rx(
    r"exceeds the total limit of containers",
    r"exceeded its local ephemeral storage limit",
    r"exceeds its limit",
    r"emptyDir usage exceeds",
)
_NODE_LOST = _rx(
    r"\bNodeLost\b", r"Node is shutting", r"\bNodeShutdown\b",
    r"\bnode\b[^\n]{0,80}\bnot ready\b",
    r"NodeNotReady",
    r"node[^\n]{0,40}unreachable",
    r"Node \S+ which was running pod \S+ is unresponsive",
)


def _first(pattern: re.Pattern[str], texts: Iterable[str]) -> tuple[str, str] | None:
    """(matched line, matched text) of the first match of `pattern` in `texts`.

    An unindented line (an exception or log line) is preferred over an indented one (the
    source line `raise X()` that a traceback prints just before the exception itself).
    """
    first: tuple[str, str] | None = None
    for text in texts:
        for match in pattern.finditer(text):
            start = text.rfind("\n", 0, match.start()) + 1
            end = text.find("\n", match.end())
            raw = text[start : end if end >= 0 else len(text)]
            found = (raw.strip(), match.group(0))
            body = raw[RANK_PREFIX.match(raw).end() :] if RANK_PREFIX.match(raw) else raw
            if not body[:1].isspace():
                return found
            first = first or found
    return first


def _line_rank(line: str) -> int | None:
    match = _RANK_IN_LINE.search(line) or RANK_PREFIX.match(line)
    if not match:
        return None
    return int(next(g for g in match.groups() if g is not None))


def judge(exc: Exc) -> catalogue.Judgement | None:
    """The catalogue's judgement of an exception: an infra cause in its chain, else its own."""
    links = exc.all()
    for cause in links[:-1]:
        found = _judge_one(cause)
        if found and found[0] == "infra":
            return found
    return _judge_one(links[-1])


def _judge_one(exc: Exc) -> catalogue.Judgement | None:
    return catalogue.judge_exception_text(
        exc.type, exc.message, raised_by_user=exc.raised_by_user, in_user_frames=exc.user_frame() is not None
    )


def _is_infra_exc(exc: Exc) -> bool:
    """The catalogue judges it infra, or a message of its chain names a broken GPU stack (user code that met one)."""
    if any(_GPU_NODE.search(link.message) for link in exc.all()):
        return True
    found = judge(exc)
    return found is not None and found[0] == "infra"


def _short_path(frame: str) -> str:
    path, _, line = frame.rpartition(":")
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:]) + (f":{line}" if line else "")


# --------------------------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hit:
    """What a rule saw: `what` names the signal, `excerpt` quotes the evidence."""

    what: str
    excerpt: str = ""
    rank: int | None = None
    step: int | None = None
    focus: str = ""  # the decisive words inside `excerpt`, kept visible when it is cut


Matcher = Callable[[Evidence], "Hit | None"]


@dataclass(frozen=True)
class Rule:
    name: str
    kind: Kind  # "unknown": the rule names the symptom but not whose fault it is (retried once)
    tier: int  # 1 Kubernetes, 2 container runtime, 3 trainer, 4 exception, 5 infra log, 6 exit code
    matcher: Matcher
    secondary: bool = False  # how a rank dies because another one did (see module docstring)
    summary: str = ""

    @property
    def retryable(self) -> bool:
        return self.kind != "user"


def _disruption_condition(f: Evidence) -> Hit | None:
    for cond in f.conditions:
        if cond.type == "DisruptionTarget" and (cond.status or "True") != "False":
            reason = cond.reason or "unspecified"
            return Hit(f"pod condition DisruptionTarget ({reason})", cond.message)
    return None


def _node_lost(f: Evidence) -> Hit | None:
    if f.pod_reason == "NodeLost" or (f.pod_phase == "Unknown" and _NODE_LOST.search(f.pod_message)):
        return Hit(f"pod reason {f.pod_reason or 'NodeLost'}", f.pod_message)
    for reason, message in f.event_texts():
        if reason in {"NodeNotReady", "NodeLost", "NodeShutdown"}:
            return Hit(f"event {reason}", message)
    if _NODE_LOST.search(f.pod_message):
        return Hit("pod message: node not ready", f.pod_message)
    if "Terminating" in (f.pod_phase, f.pod_reason):  # stuck: its node stopped answering the kubelet's deletes
        return Hit("pod stuck Terminating (its node stopped answering)", f.pod_message)
    return None


def _preempted(f: Evidence) -> Hit | None:
    if f.pod_reason in {"Preempting", "Preempted"}:
        return Hit(f"pod reason {f.pod_reason}", f.pod_message)
    for reason, message in f.event_texts():
        if reason == "Preempted" or reason == "Preempting" or "Preempted to accommodate" in message:
            return Hit(f"event {reason}", message)
    if f.termination_reason in {"Preempted", "Preempting"}:
        return Hit(f"termination reason {f.termination_reason}")
    hit = _slurm_cancelled(f, "PREEMPTION")
    if hit:
        return hit
    found = _first(_LSF_PREEMPTED, f.log_texts)
    return Hit("LSF preempted the job", found[0], focus=found[1]) if found else None


def _worker_cluster_lost(f: Evidence) -> Hit | None:
    """MultiKueue: Kueue evicts a Workload with reason AdmissionCheck when its MultiKueue check goes
    back to Retry (the worker cluster running it was lost past workerLostTimeout, or its copy there
    was removed); the gang is dispatched again."""
    for c in f.conditions:  # a Rejected check also evicts with this reason ("... were rejected"): not a loss
        if c.type == "Evicted" and c.reason == "AdmissionCheck" and "rejected" not in c.message.lower():
            return Hit("Kueue evicted the Workload: an admission check (MultiKueue: its worker cluster) went back to Retry", c.message)
    return None


def _container_limit_eviction(f: Evidence) -> Hit | None:
    texts = [f.pod_message] if f.pod_reason == "Evicted" else []
    texts += [m for _, m in f.event_texts("Evicted")]
    texts += [c.message for c in f.conditions if c.type == "DisruptionTarget"]
    for text in texts:
        if _CONTAINER_LIMIT.search(text):
            return Hit("evicted for exceeding the pod's own limit", text)
    return None


# The kubelet's eviction message under memory pressure: "Container X was using 1783932Ki, which
# exceeds its request of 0." A pod that requested no memory is the first one evicted.
_NO_MEMORY_REQUEST = re.compile(r"Container \S+ was using (\d+)(Ki|Mi|Gi)?, which exceeds its request of 0\b")
_MEMORY_PRESSURE = _rx(r"low on resource: memory", r"\bMemoryPressure\b", r"\bSystemOOM\b", r"System OOM encountered")


def _evicted_without_memory_request(f: Evidence) -> Hit | None:
    """Evicted under node memory pressure while using memory it never requested: set a request."""
    texts = [f.pod_message] if f.pod_reason == "Evicted" or f.termination_reason == "Evicted" else []
    texts += [m for _, m in f.event_texts("Evicted")]
    for text in texts:
        if not re.search(r"low on resource: memory", text):
            continue
        for match in _NO_MEMORY_REQUEST.finditer(text):
            scale = {"Ki": 1, "Mi": 1024, "Gi": 1024 * 1024}.get(match.group(2) or "", 1 / 1024)
            if int(match.group(1)) * scale >= 100 * 1024:  # a real workload, not a 13 MiB sidecar
                return Hit("evicted under node memory pressure using memory it never requested (set a memory request)", text)
    return None


def _oom_killed_by_node_pressure(f: Evidence) -> Hit | None:
    """OOMKilled while the node itself ran out of memory (the kubelet reports a system OOM)."""
    if "OOMKilled" not in (f.termination_reason, f.pod_reason):
        return None
    texts = [f.pod_message, *(f"{r} {m}" for r, m in f.event_texts()), *(f"{c.type} {c.reason} {c.message}" for c in f.conditions)]
    hit = _first(_MEMORY_PRESSURE, texts)
    return Hit("OOMKilled while the node was out of memory (node pressure)", hit[0], focus=hit[1]) if hit else None


def _evicted(f: Evidence) -> Hit | None:
    if f.pod_reason == "Evicted" or f.termination_reason == "Evicted":
        return Hit("pod reason Evicted", f.pod_message)
    for reason, message in f.event_texts("Evicted"):
        return Hit(f"event {reason}", message)
    for cond in f.conditions:
        if "Evicted" in cond.reason:
            return Hit(f"condition {cond.type} ({cond.reason})", cond.message)
    hit = _first(_NODE_PRESSURE, [f.pod_message, *(m for _, m in f.event_texts()), f.log_tail])
    if hit:
        return Hit("the node could not keep or admit the pod (node pressure)", hit[0], focus=hit[1])
    if re.fullmatch(r"OutOf[\w./-]+", f.pod_reason):
        return Hit(f"pod reason {f.pod_reason} (the node's devices were taken when the pod was admitted)", f.pod_message)
    return None


def _collective_timeout(f: Evidence) -> Hit | None:
    hit = _first(_COLLECTIVE_TIMEOUT, f.log_texts)
    what = "collective timeout (a peer stopped answering, or one rank was busy alone or ran out of data)"
    return Hit(what, hit[0], _line_rank(hit[0]), focus=hit[1]) if hit else None


def _single_rank_work_timeout(f: Evidence) -> Hit | None:
    """A collective timed out while this rank's log shows long work of its own (the others waited)."""
    hit = _first(_COLLECTIVE_TIMEOUT, [f.log_tail])
    if hit is None:
        return None
    before = f.log_tail[: f.log_tail.find(hit[1])]
    work = _SINGLE_RANK_WORK.search(before)
    if work is None:
        return None
    return Hit(
        "collective timeout while one rank was still working alone (raise the process-group timeout or "
        "move the work before init_process_group)", hit[0], _line_rank(hit[0]), focus=hit[1]
    )


def _oom_killed(f: Evidence) -> Hit | None:
    if f.termination_reason == "OOMKilled" or f.pod_reason == "OOMKilled":
        code = f" (exit code {f.exit_code})" if f.exit_code is not None else ""
        return Hit(f"container OOMKilled{code}: its memory limit is too small for the job", f.pod_message)
    return None


def _image_events(f: Evidence) -> list[tuple[str, str]]:
    pull = {"errimagepull", "imagepullbackoff", "backoff", "failed", "failed to pull image", "invalidimagename"}
    found = [(r, m) for r, m in f.event_texts() if r.lower() in pull and re.search(r"pull|image|manifest", m, re.I)]
    pulling = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
    if f.pod_reason in pulling or f.termination_reason in pulling:  # a waiting container's reason
        found.append((f.termination_reason if f.termination_reason in pulling else f.pod_reason, f.pod_message))
    return found


def _image_throttled(f: Evidence) -> Hit | None:
    for reason, message in _image_events(f):
        match = _IMAGE_THROTTLED.search(message)
        if match:
            return Hit(f"image pull throttled (event {reason})", message, focus=match.group(0))
    return None


def _image_missing(f: Evidence) -> Hit | None:
    for reason, message in _image_events(f):
        matches = list(_IMAGE_MISSING.finditer(message))  # the registry's verdict ends the message
        if matches or reason == "InvalidImageName":
            focus = message[matches[0].start() : matches[-1].end()] if matches else ""
            return Hit(f"image cannot be pulled (event {reason})", message, focus=focus)
    return None


def _create_container_config_error(f: Evidence) -> Hit | None:
    if "CreateContainerConfigError" in (f.pod_reason, f.termination_reason):
        return Hit("CreateContainerConfigError (a missing Secret/ConfigMap or key)", f.pod_message)
    for reason, message in f.event_texts():
        if reason == "CreateContainerConfigError" or re.search(
            r"(?:secrets?|configmaps?) \"[^\"]+\" not found|couldn't find key \S+ in (?:Secret|ConfigMap)", message
        ):
            return Hit("CreateContainerConfigError (a missing Secret/ConfigMap or key)", message)
    return None


# Slurm's word on a cancelled job or step: "slurmstepd: error: *** JOB 1234 ON node7 CANCELLED AT
# 2024-01-01T00:00:00 DUE TO TIME LIMIT ***" (also DUE TO PREEMPTION / NODE FAILURE).
_SLURM_CANCELLED = re.compile(r"\*\*\* (?:JOB|STEP) \S+ ON \S+ CANCELLED AT \S+ DUE TO (TIME LIMIT|PREEMPTION)")
# Nextflow's word on a task past the `time` directive the pipeline's configuration gives it.
_NEXTFLOW_TIME_LIMIT = re.compile(r"Process exceeded running time limit \(\S{1,32}\)")
# PBS/Torque's and LSF's word on a job past the run time its submission asked for (as Slurm's TIME LIMIT).
_BATCH_TIME_LIMIT = _rx(r"PBS: job killed: walltime \d{1,12} exceeded limit \d{1,12}", r"TERM_RUNLIMIT: job killed after reaching LSF run time limit")
# LSF's word on a job killed at another limit its submission or queue sets (bsub -M, -T, -p, -v, -c;
# IBM's "Termination reasons displayed by bacct, bhist, and bjobs"): the request must change.
_LSF_OWN_LIMIT = re.compile(r"TERM_(?:MEMLIMIT|THREADLIMIT|PROCESSLIMIT|SWAP|CPULIMIT): job killed after reaching LSF "
                            r"(?:memory usage|thread|process|swap usage|CPU usage) limit")
_LSF_PREEMPTED = re.compile(r"TERM_PREEMPT: job killed after preemption")


def _slurm_cancelled(f: Evidence, why: str) -> Hit | None:
    for text in f.log_texts:
        match = _SLURM_CANCELLED.search(text)
        if match and match.group(1) == why:
            return Hit(f"Slurm cancelled the job: {why.lower()}", match.group(0), focus=match.group(0))
    return None


def _deadline_exceeded(f: Evidence) -> Hit | None:
    if f.pod_reason == "DeadlineExceeded" or f.termination_reason == "DeadlineExceeded":
        # a pod's activeDeadlineSeconds, or gangflow's own stop at training.max_run_time_seconds
        return Hit("reason DeadlineExceeded: the gang's run-time limit was reached", f.pod_message)
    hit = _slurm_cancelled(f, "TIME LIMIT")
    if hit:
        return Hit(hit.what + " (the job's --time is too short)", hit.excerpt, focus=hit.focus)
    found = _first(_NEXTFLOW_TIME_LIMIT, f.log_texts)
    if found:
        return Hit("Nextflow: the process ran past its time directive", found[0], focus=found[1])
    found = _first(_BATCH_TIME_LIMIT, f.log_texts)
    return Hit("the batch scheduler killed the job at the run time it asked for (walltime)", found[0], focus=found[1]) if found else None


def _trainer_preempted(f: Evidence) -> Hit | None:
    if f.exit_code == EXIT_PREEMPTED:
        return Hit(f"trainer exit code {EXIT_PREEMPTED} (stopped on SIGTERM, the preemption path)")
    return None


def _trainer_config_error(f: Evidence) -> Hit | None:
    rec = f.record
    if rec is not None and rec.source == "config":
        exc = rec.exc
        return Hit(f"bad config ({exc.name if exc else 'trainer error record'})", exc.message if exc else "")
    if f.exit_code == EXIT_CONFIG_ERROR:
        usage = _first(re.compile(r"^.*error: .*$", re.MULTILINE), [f.log_tail])
        return Hit(f"trainer exit code {EXIT_CONFIG_ERROR} (bad command line or config)", usage[0] if usage else "")
    return None


def _trainer_user_record(f: Evidence) -> Hit | None:
    rec = f.record
    if rec is None or rec.source != "user" or rec.exc is None or _is_infra_exc(rec.exc):
        return None
    return Hit(f"{rec.exc.name} raised in training code", rec.exc.message, rec.rank, rec.step)


def _candidate_exceptions(f: Evidence) -> list[Exc]:
    excs = [e for e in f.tracebacks if e.name not in _WRAPPERS]
    rec = f.record
    if rec is not None and rec.exc is not None and rec.source is None and rec.exc.name not in _WRAPPERS:
        excs.insert(0, rec.exc)
    return excs


def _cuda_oom(f: Evidence) -> Hit | None:
    for exc in _candidate_exceptions(f):
        if _CUDA_OOM.search(exc.text):
            return Hit(_device_oom_words(exc.text), exc.text, exc.rank)
    hit = _first(_CUDA_OOM, f.log_texts)
    if hit:
        return Hit(_device_oom_words(hit[0]), hit[0], _line_rank(hit[0]))
    return None


def _device_oom_words(text: str) -> str:
    if any(word in text for word in ("XLA:TPU", "memory space hbm", "memory space vmem", "Failed to allocate request for")):
        return "TPU out of memory (batch or model too large for the TPU)"
    return "CUDA out of memory (batch or model too large for the GPU)"


def _import_error(f: Evidence) -> Hit | None:
    for exc in _candidate_exceptions(f):
        if exc.name in {"ModuleNotFoundError", "ImportError", "SyntaxError", "IndentationError", "TabError"}:
            return Hit(f"{exc.name} (the code or its environment is broken)", exc.message, exc.rank)
    for text in f.log_texts:
        match = _IMPORT_ERROR.search(text)
        if match:
            return Hit(f"{match.group(1)} (the code or its environment is broken)", match.group(0).strip())
    return None


def _gpu_hardware(f: Evidence) -> Hit | None:
    for text in f.log_texts:
        for match in _XID.finditer(text):
            if int(match.group(1)) not in _APP_XIDS:
                line = text[text.rfind("\n", 0, match.start()) + 1 :].split("\n", 1)[0]
                return Hit(f"GPU hardware error (Xid {match.group(1)})", line.strip())
    hit = _first(_GPU_HARDWARE, f.log_texts)
    if hit:
        return Hit(f"GPU hardware error ({hit[1]})", hit[0], _line_rank(hit[0]), focus=hit[1])
    return None


def _invalid_device(f: Evidence) -> Hit | None:
    """A GPU index that does not exist; not when no device was found at all (every index is invalid then)."""
    if _first(_NO_DEVICE, _all_texts(f)):
        return None
    return _INVALID_DEVICE_HIT(f)


def _illegal_memory_access(f: Evidence) -> Hit | None:
    hit = _first(_ILLEGAL_ACCESS, f.log_texts)
    if hit is None or _gpu_hardware(f) is not None:
        return None
    return Hit(f"{hit[1]} (a kernel or indexing bug; rerun with CUDA_LAUNCH_BLOCKING=1)", hit[0], _line_rank(hit[0]))


def _user_exception(f: Evidence) -> Hit | None:
    if f.record is not None and f.record.source_given and f.record.source is None:
        return None  # the trainer's record says this exception did not come from user code
    for exc in _candidate_exceptions(f):
        if _is_infra_exc(exc):
            continue
        frame = exc.user_frame()
        if frame is None:
            continue
        rec = f.record
        step = rec.step if rec is not None and rec.exc is exc else None
        return Hit(f"{exc.name} raised in training code", f"{exc.message} ({_short_path(frame)})", exc.rank, step)
    return None


def _image_pull_failed(f: Evidence) -> Hit | None:
    """An image that cannot be pulled (no throttling said): the reference or its credentials are wrong."""
    texts = [f.pod_reason, f.termination_reason, f.pod_message, *(m for _, m in f.event_texts()), f.log_tail]
    hit = _first(_rx(r"\bErrImagePull\b", r"\bImagePullBackOff\b", r"Back-off pulling image", r"\bInvalidImageName\b"), texts)
    if hit is None or _first(_IMAGE_THROTTLED, texts):
        return None
    return Hit("image cannot be pulled (ErrImagePull/ImagePullBackOff)", hit[0], focus=hit[1])


def _user_exception_line(f: Evidence) -> Hit | None:
    """A bare exception line (no traceback) whose type says the program is wrong."""
    if f.record is not None and f.record.source_given and f.record.source is None:
        return None
    for exc in _bare_exceptions(f, after=_HANDLED):
        if exc.name in catalogue.USER_EXCEPTION_NAMES and judge(exc) is None:
            return Hit(f"{exc.name} (the program, its config or its data is wrong)", exc.text, exc.rank, focus=exc.name)
    return None


def _infra_exception(f: Evidence) -> Hit | None:
    for exc in [*_candidate_exceptions(f), *_bare_exceptions(f)]:
        found = judge(exc)
        if found and found[0] == "infra":
            return Hit(found[1], exc.text, exc.rank, focus=exc.name)
    return None


# Python's chained traceback: the exceptions above this line were handled; a later one ended the program.
_HANDLED = "During handling of the above exception, another exception occurred"


def _bare_exceptions(f: Evidence, *, after: str | None = None) -> list[Exc]:
    """Exception lines printed without a traceback ("RuntimeError: ..." at a line start), last first;
    with `after`, only those below the last line that holds it."""
    lines = f.log_tail.splitlines()[-400:]
    if after is not None:
        marks = [i for i, line in enumerate(lines) if after in line]
        lines = lines[marks[-1] + 1 :] if marks else lines
    found = []
    for line in reversed(lines):
        body = line[RANK_PREFIX.match(line).end() :] if RANK_PREFIX.match(line) else line
        parsed = parse_exception_line(body)
        if parsed and parsed[1] and (parsed[0].endswith(("Error", "Exception", "Exit", "Interrupt")) or "." in parsed[0]):
            found.append(Exc(parsed[0], parsed[1], rank=_line_rank(line)))
    return found


def _all_texts(f: Evidence) -> list[str]:
    """Logs, the error record, the pod message, events' and conditions' messages."""
    return [*f.log_texts, *(m for _, m in f.event_texts()), *(c.message for c in f.conditions)]


def _text_rule(pattern: re.Pattern[str], what: str) -> Matcher:
    def matcher(f: Evidence) -> Hit | None:
        hit = _first(pattern, _all_texts(f))
        return Hit(what, hit[0], _line_rank(hit[0]), focus=hit[1]) if hit else None

    return matcher


def _log_rule(pattern: re.Pattern[str], what: str) -> Matcher:
    def matcher(f: Evidence) -> Hit | None:
        hit = _first(pattern, f.log_texts)
        return Hit(what, hit[0], _line_rank(hit[0]), focus=hit[1]) if hit else None

    return matcher


_INVALID_DEVICE_HIT = _text_rule(_INVALID_DEVICE, "a GPU index that does not exist (device ordinal)")  # _invalid_device's


# A refusal that says it is throttling (GitHub's and GCS's 403 "rate limit exceeded") is transient.
_THROTTLED = _rx(r"rate ?limit", r"\brateLimitExceeded\b", r"\bthrottl\w*", r"\bSlowDown\b")


def _request_refused(f: Evidence) -> Hit | None:
    texts = _all_texts(f)
    hit = _first(_REQUEST_REFUSED, texts)
    # gdown prints Drive's download quota on the lines after its "Access denied"
    if hit is None or _THROTTLED.search(hit[0]) or _first(catalogue.DOWNLOAD_QUOTA, texts):
        return None
    return Hit("storage/API refused the request (credentials, permissions, missing bucket)", hit[0], _line_rank(hit[0]), focus=hit[1])


def _failed_scheduling(f: Evidence) -> Hit | None:
    for reason, message in f.event_texts("FailedScheduling"):
        return Hit("event FailedScheduling (no room for the gang right now)", message)
    return None


def _signal_hit(f: Evidence, number: int, what: str) -> Hit | None:
    if f.signal == number:
        how = f"exit code {f.exit_code}" if f.exit_code is not None else "signal"
        return Hit(f"{SIGNAL_NAMES[number]} ({how}){what}")
    if f.signal is None and f.launcher_signal == number:
        line = _first(LAUNCHER_EXIT, [f.log_tail]) or _first(MPIRUN_SIGNAL, [f.log_tail])
        return Hit(f"{SIGNAL_NAMES[number]} ({f.launcher_line}){what}", line[0] if line else "")
    return None


def _native_crash(f: Evidence) -> Hit | None:
    hit = _first(NATIVE_CRASH, f.log_texts)
    if hit:
        return Hit("native crash (a bug in compiled code, or the node's memory or GPU)", hit[0], _line_rank(hit[0]), focus=hit[1])
    return _signal_hit(f, 11, "")


def _sigterm(f: Evidence) -> Hit | None:
    return _signal_hit(f, 15, ": the preemption/eviction path")


# The words of a SIGKILL no pod status explains (context.weigh rewrites them when no OOM count does either).
KILLED_FROM_OUTSIDE = " without OOMKilled: killed from outside"


# A shell's report of a child it lost to SIGKILL: bash's "line 27: 318 Killed  python ...", a line
# that is only "Killed" (or ends a progress bar's line: the bar redraws with \r, no newline), zsh's
# "killed", the Chinese locale's; the log's only trace of the signal.
_SHELL_KILLED = re.compile(
    r"^[^\n]{0,200}\bline \d+:[ \t]+\d+[ \t]+Killed\b[^\n]*$|^[ \t]*(?:\*\*)?Killed(?:\*\*)?[ \t]*$|^[^\n]*[\]\d]Killed[ \t]*$"
    r"|^zsh: killed\b[^\n]*$|已杀死",
    re.MULTILINE,
)
# Nextflow found no exit status for the task: its executor (Slurm, Kubernetes, AWS Batch) killed it,
# as a shell's "Killed" says (memory, preemption, a node lost).
_NEXTFLOW_KILLED = _rx(r"terminated for an unknown reason[\s-]{0,12}Likely it has been terminated by the external system")


def _sigkill(f: Evidence) -> Hit | None:
    hit = _signal_hit(f, 9, KILLED_FROM_OUTSIDE)
    if hit is None and f.signal is None and f.launcher_signal is None:
        found = _first(_SHELL_KILLED, [f.log_tail])
        if found:
            return Hit(f"SIGKILL (the shell says Killed){KILLED_FROM_OUTSIDE}", found[0], _line_rank(found[0]), focus=found[1])
        found = _first(_NEXTFLOW_KILLED, [f.log_tail])
        if found:
            return Hit(f"a kill (Nextflow: the executor ended the task, no exit status){KILLED_FROM_OUTSIDE}", found[0],
                       _line_rank(found[0]), focus=found[1])
    return hit


RULES: tuple[Rule, ...] = (
    # 1. Kubernetes said why.
    Rule("evicted-over-own-limit", "user", 1, _container_limit_eviction, summary="Evicted: pod exceeded its own limit"),
    Rule("k8s-disruption", "infra", 1, _disruption_condition, summary="DisruptionTarget pod condition"),
    Rule("node-lost", "infra", 1, _node_lost, summary="NodeLost / NodeNotReady / node not ready"),
    Rule("k8s-preempted", "infra", 1, _preempted, summary="pod reason Preempting, event Preempted, Slurm DUE TO PREEMPTION, LSF TERM_PREEMPT"),
    Rule("worker-cluster-lost", "infra", 1, _worker_cluster_lost, summary="Kueue Workload Evicted, reason AdmissionCheck (MultiKueue worker lost)"),  # fmt: skip
    Rule("evicted-no-memory-request", "user", 1, _evicted_without_memory_request, summary="Evicted for node memory pressure, container used memory with request 0"),  # fmt: skip
    Rule("k8s-evicted", "infra", 1, _evicted, summary="pod reason / event Evicted (node pressure)"),
    Rule("cloud-preemption", "infra", 1, _text_rule(_CLOUD_PREEMPTION, "the cloud provider reclaimed the machine"), summary="spot/preemptible interruption, instance preempted"),  # fmt: skip
    Rule("node-gone", "infra", 1, _text_rule(_NODE_GONE, "the node died or was removed under the job"), summary="node marked dead, shut down, terminated"),  # fmt: skip
    Rule("quota-exceeded", "user", 1, _text_rule(_QUOTA, "an account/namespace quota or limit refuses the request"), summary="*LimitExceeded, quota exceeded, service limit"),  # fmt: skip
    Rule("no-capacity", "infra", 1, _text_rule(_NO_CAPACITY, "the cloud has no capacity for the request right now"), summary="insufficient capacity, stockout"),  # fmt: skip
    Rule("admission-rejected", "user", 1, _text_rule(_ADMISSION_REJECTED, "the Kubernetes API refused the object"), summary="admission webhook denied, quota exceeded, invalid field"),  # fmt: skip
    # 2. The container runtime said why.
    Rule("oom-killed-node-pressure", "infra", 2, _oom_killed_by_node_pressure, summary="OOMKilled with a system OOM / MemoryPressure on the node"),  # fmt: skip
    Rule("oom-killed", "user", 2, _oom_killed, summary="termination reason OOMKilled"),
    Rule("image-pull-throttled", "infra", 2, _image_throttled, summary="pull failed: toomanyrequests / 429"),
    Rule("image-missing", "user", 2, _image_missing, summary="pull failed: manifest unknown / not found / unauthorized"),
    Rule("image-pull-failed", "user", 2, _image_pull_failed, summary="ErrImagePull / ImagePullBackOff, no throttling"),
    Rule("container-config-error", "user", 2, _create_container_config_error, summary="CreateContainerConfigError"),
    Rule("deadline-exceeded", "user", 2, _deadline_exceeded, summary="pod reason DeadlineExceeded, Slurm DUE TO TIME LIMIT, PBS/LSF walltime, Nextflow's time directive"),
    Rule("batch-own-limit", "user", 2, _log_rule(_LSF_OWN_LIMIT, "LSF killed the job at a limit its submission or queue sets"), summary="LSF TERM_MEMLIMIT / THREADLIMIT / PROCESSLIMIT / SWAP / CPULIMIT"),  # fmt: skip
    # 3. The trainer said why.
    Rule("trainer-preempted-exit", "infra", 3, _trainer_preempted, summary=f"trainer exit code {EXIT_PREEMPTED}"),
    Rule("trainer-config-error", "user", 3, _trainer_config_error, summary=f"error record source config / exit code {EXIT_CONFIG_ERROR}"),
    Rule("trainer-user-error", "user", 3, _trainer_user_record, summary="error record source user, its exception not infra nor a broken GPU stack"),
    # 4. An exception from the training process.
    Rule("cuda-oom", "user", 4, _cuda_oom, summary="device out of memory (CUDA, NCCL, XLA, TF)"),
    Rule("host-oom", "user", 4, _text_rule(_HOST_OOM, "the kernel's OOM killer: the job needs more memory than it asked for"), summary="oom-killer, memory cgroup out of memory"),  # fmt: skip
    Rule("single-rank-work-timeout", "user", 4, _single_rank_work_timeout, summary="collective timeout after one rank's long preprocessing"),  # fmt: skip
    Rule("import-error", "user", 4, _import_error, summary="ModuleNotFoundError / ImportError / SyntaxError"),
    Rule("environment-mismatch", "user", 4, _text_rule(_ENVIRONMENT, "the image's software does not fit (versions, build, architecture)"), summary="version mismatch, failed extension build, missing library, illegal CPU instruction"),  # fmt: skip
    Rule("illegal-memory-access", "user", 4, _illegal_memory_access, summary="CUDA illegal memory access, no Xid/ECC"),
    Rule("invalid-device", "user", 4, _invalid_device, summary="CUDA invalid device ordinal (not when no device is detected)"),
    Rule("no-gpu-visible", "user", 4, _text_rule(_NO_GPU_VISIBLE, "the job sees no GPU (its resource request, CUDA_VISIBLE_DEVICES or a CPU-only build)"), summary="No CUDA GPUs are available"),  # fmt: skip
    Rule("nccl-system-error", "user", 4, _log_rule(_NCCL_SYSTEM, "NCCL could not set up its transport here (/dev/shm, sockets, IB libraries; NCCL_DEBUG=INFO names it)"), summary="NCCL unhandled system error"),  # fmt: skip
    Rule("checkpoint-mismatch", "user", 4, _text_rule(_CHECKPOINT_MISMATCH, "the checkpoint does not fit the model"), summary="state_dict missing/unexpected keys, size mismatch"),  # fmt: skip
    Rule("shm-too-small", "user", 4, _text_rule(_SHM_TOO_SMALL, "/dev/shm too small for the DataLoader workers"), summary="DataLoader worker Bus error, /dev/shm full"),  # fmt: skip
    Rule("user-exception", "user", 4, _user_exception, summary="traceback through the trainer's/user's frames"),
    Rule("user-exception-line", "user", 4, _user_exception_line, summary="a bare ValueError/KeyError/TypeError... line"),
    Rule("program-error", "user", 4, _text_rule(_PROGRAM_ERROR, "the program broke a tensor/API contract"), summary="shape/dtype/device mismatch, DDP unused parameters"),  # fmt: skip
    Rule("config-invalid", "user", 4, _text_rule(_CONFIG_INVALID, "the job's config or command line is invalid"), summary="pydantic validation error, argparse error"),  # fmt: skip
    Rule("server-certificate-expired", "infra", 4, _text_rule(_CERT_EXPIRED, "the server's TLS certificate has expired (its owner renews it)"), summary="certificate has expired"),  # fmt: skip
    Rule("tls-certificate", "user", 4, _text_rule(_TLS_CERTIFICATE, "the client does not trust the server's TLS certificate (CA bundle, proxy)"), summary="certificate verify failed, self-signed certificate"),  # fmt: skip
    Rule("disk-full", "user", 4, _text_rule(DISK_FULL, "a disk the job writes to is full (its own output, or a node's disk others filled)"), summary="No space left on device, ENOSPC (retried once)"),  # fmt: skip
    Rule("launch-config-error", "user", 4, _text_rule(_LAUNCH_CONFIG, "the launch is misconfigured"), summary="address already in use, ssh between nodes"),  # fmt: skip
    Rule("request-refused", "user", 4, _request_refused, summary="AccessDenied, 403, NoSuchBucket (not a throttling 403)"),
    Rule("bad-data", "user", 4, _text_rule(_BAD_DATA, "the data is broken"), summary="corrupt images, checksum mismatch, truncated torch.load file"),  # fmt: skip
    # 5. Infrastructure log patterns.
    Rule("gpu-hardware", "infra", 5, _gpu_hardware, summary="NVRM Xid (hardware), ECC, unspecified launch failure"),
    Rule("gpu-node-fault", "infra", 5, _text_rule(_GPU_NODE, "the node's GPU stack is broken"), summary="NVML init failure, driver/library mismatch, GSP timeout, no CUDA/ROCm device detected, CUDA unknown error"),  # fmt: skip
    # A watchdog timeout with nothing else in view is as often the program's (rank-0-only
    # evaluation or preprocessing, ranks with unequal batch counts) as a hung network: not a
    # confident infra verdict. A peer's own failure (SIGKILL, preemption, exception) decides
    # instead when its evidence is there.
    Rule(
        "collective-timeout", "unknown", 5, _collective_timeout,
        secondary=True, summary="NCCL/gloo watchdog timeout",
    ),  # fmt: skip
    Rule(
        "peer-connection-lost", "infra", 5, _log_rule(_PEER_LOST, "connection to a peer lost"),
        secondary=True, summary="Connection closed/reset by peer, ncclRemoteError",
    ),  # fmt: skip
    Rule(
        "rendezvous-failure", "infra", 5, _log_rule(_RENDEZVOUS, "rendezvous failed"),
        secondary=True, summary="RendezvousTimeoutError / RendezvousClosedError",
    ),  # fmt: skip
    Rule("transient-storage", "infra", 5, _log_rule(_STORAGE, "transient storage error"), summary="EIO, ESTALE, S3 SlowDown, 503"),  # fmt: skip
    Rule("transient-network", "infra", 5, _log_rule(_NETWORK, "transient network error"), summary="DNS, ConnectionError"),  # fmt: skip
    Rule("remote-service-unavailable", "infra", 5, _log_rule(catalogue.HTTP_TRANSIENT, "a remote service is unavailable or throttling"), summary="HTTP 5xx (not 501/505), 429, 408"),  # fmt: skip
    Rule("infra-exception", "infra", 5, _infra_exception, summary="an exception whose type only infrastructure raises"),
    Rule("failed-scheduling", "infra", 5, _failed_scheduling, summary="event FailedScheduling"),
    Rule("service-says-retry", "infra", 5, _text_rule(catalogue.RETRY_LATER, "the service says the failure is temporary"), summary="try again later"),  # fmt: skip
    Rule("native-crash", "user", 6, _native_crash, summary="Segmentation fault / SIGSEGV, glibc heap corruption, nothing else in view (retried once)"),  # fmt: skip
    # 6. The exit code or signal alone.
    Rule("sigterm", "infra", 6, _sigterm, secondary=True, summary="SIGTERM / exit code 143"),
    Rule("killed-from-outside", "infra", 6, _sigkill, summary="SIGKILL / exit code 137 / a shell's Killed / Nextflow's terminated by the external system, without OOMKilled"),  # fmt: skip
)
RULE_INDEX = {rule.name: i for i, rule in enumerate(RULES)}
