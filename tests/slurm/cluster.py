"""A real Slurm cluster on this one host, for tests: munged, slurmctld and two slurmd nodes
(`slurmd -N node1`, `slurmd -N node2`), each with its own port, spool and log, all configured
by a slurm.conf written into a temporary directory. Nothing is installed system-wide except the
Debian packages themselves (installed by ensure_slurm() where missing, as root); nothing keeps
running after stop().

    with SlurmCluster() as cluster:
        job = cluster.sbatch(["scripts/slurm/x.sbatch"], env=...)
        cluster.wait(job, {"COMPLETED"})

The client commands find this cluster through SLURM_CONF (cluster.env). Also usable by hand:
    python tests/slurm/cluster.py     (prints SLURM_CONF=..., stays up until Ctrl-C)
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable

DEBIAN_PACKAGES = ["slurmd", "slurmctld", "slurm-client", "munge"]
BINARIES = ["munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue"]
NODES = ("node1", "node2")
# Job states after which a job runs no more (squeue/scontrol's long names).
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here (the tests skip with this message)."""


def missing_binaries() -> list[str]:
    return [
        b
        for b in BINARIES
        if shutil.which(b) is None and not os.path.exists(os.path.join("/usr/sbin", b))
    ]


def ensure_slurm(install: bool = True) -> None:
    """Install Debian's slurm and munge packages when missing (as root, with apt-get)."""
    if not missing_binaries():
        return
    if not install or os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable(
            f"missing {missing_binaries()}; install them with: apt-get "
            f"install -y {' '.join(DEBIAN_PACKAGES)}"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *DEBIAN_PACKAGES]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # stale package lists on a fresh machine
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0 or missing_binaries():
        raise SlurmUnavailable(
            f"apt-get install {' '.join(DEBIAN_PACKAGES)} failed:\n"
            f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )


def _sbin(name: str) -> str:
    return shutil.which(name) or os.path.join("/usr/sbin", name)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


SLURM_CONF = """\
ClusterName=ulcluster
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={dir}/munge.socket,cred_expire={cred_expire}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/ctld
SlurmdSpoolDir={dir}/slurmd.%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a container: track a job's processes through /proc (every descendant).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
# Short timers so that tests spend their time training, not waiting on the scheduler.
KillWait={kill_wait}
MinJobAge=300
MessageTimeout=20
SlurmdTimeout=60
InactiveLimit=0
Waittime=0
OverTimeLimit=0
UnkillableStepTimeout=120
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
{nodes}
# Jobs in "priority" preempt (requeue, after GraceTime) jobs in "batch"; nothing preempts them.
PartitionName=batch Nodes={node_list} Default=YES PriorityTier=1 GraceTime={grace_time}
PartitionName=priority Nodes={node_list} PriorityTier=2 PreemptMode=OFF
"""


class SlurmCluster:
    """munged + slurmctld + one slurmd per node name, on loopback. Use as a context manager."""

    def __init__(
        self,
        cpus_per_node: int = 4,
        kill_wait: int = 10,
        grace_time: int = 30,
        cred_expire: int = 10,
        install: bool = True,
        keep_dir: bool = False,
    ):
        self.cpus_per_node, self.kill_wait, self.grace_time = cpus_per_node, kill_wait, grace_time
        self.cred_expire = cred_expire
        self.install, self.keep_dir = install, keep_dir
        self.dir: str | None = None
        self.procs: list[subprocess.Popen] = []
        self.env: dict[str, str] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        ensure_slurm(self.install)
        self.dir = tempfile.mkdtemp(prefix="slurm-test-")
        atexit.register(self.stop)  # also when the test run ends without the fixture's teardown
        os.chmod(self.dir, 0o755)  # munged refuses group/world-writable socket directories
        try:
            self._start_munge()
            self._write_conf()
            self.env = dict(os.environ, SLURM_CONF=self.conf)
            self._spawn([_sbin("slurmctld"), "-D", "-i", "-f", self.conf], "slurmctld.out")
            self._wait_for(
                lambda: self._run(["scontrol", "ping"]).returncode == 0,
                "slurmctld to answer scontrol ping",
                30,
            )
            for node in NODES:
                self._spawn(
                    [_sbin("slurmd"), "-D", "-N", node, "-f", self.conf], f"slurmd.{node}.out"
                )
            self._wait_for(self._nodes_idle, "both slurmd nodes to be idle", 60)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel every job, stop every daemon this cluster started (SIGTERM, then SIGKILL) and
        delete its directory."""
        if self.env and self.procs:
            self._run(["scancel", "--full", "--signal=KILL", "--user", "root"], timeout=10)
            self._run(["scancel", "--user", "root"], timeout=10)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        self._kill_leftover_job_processes()
        if self.dir and not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        atexit.unregister(self.stop)

    # -- daemons -----------------------------------------------------------------------------
    @property
    def conf(self) -> str:
        return os.path.join(self.dir, "slurm.conf")

    def _spawn(self, cmd: list[str], log: str) -> subprocess.Popen:
        out = open(os.path.join(self.dir, log), "wb")
        # A session of its own: a Ctrl-C in the test's terminal does not reach the daemons.
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            env=self.env or None,
            start_new_session=True,
        )
        out.close()
        self.procs.append(proc)
        return proc

    def _start_munge(self) -> None:
        key = os.path.join(self.dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        proc = self._spawn(
            [
                _sbin("munged"),
                "--foreground",
                "--force",
                f"--socket={self.dir}/munge.socket",
                f"--key-file={key}",
                f"--pid-file={self.dir}/munged.pid",
                f"--log-file={self.dir}/munged.log",
                f"--seed-file={self.dir}/munged.seed",
            ],
            "munged.out",
        )
        socket_path = os.path.join(self.dir, "munge.socket")
        self._wait_for(
            lambda: os.path.exists(socket_path) or proc.poll() is not None, "munged's socket", 15
        )
        if proc.poll() is not None:
            raise SlurmUnavailable(
                "munged exited: " + self.read("munged.out") + self.read("munged.log")
            )

    def _write_conf(self) -> None:
        ports = _free_ports(1 + len(NODES))
        nodes = "\n".join(
            f"NodeName={name} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 "
            f"Port={port} CPUs={self.cpus_per_node} RealMemory=4000 State=UNKNOWN"
            for name, port in zip(NODES, ports[1:])
        )
        os.makedirs(os.path.join(self.dir, "ctld"))
        for name in NODES:
            os.makedirs(os.path.join(self.dir, f"slurmd.{name}"))
        with open(self.conf, "w") as f:
            f.write(
                SLURM_CONF.format(
                    host=socket.gethostname(),
                    ctld_port=ports[0],
                    dir=self.dir,
                    nodes=nodes,
                    node_list=",".join(NODES),
                    kill_wait=self.kill_wait,
                    grace_time=self.grace_time,
                    cred_expire=self.cred_expire,
                )
            )

    def _nodes_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split()
        states = dict(zip(out[0::2], out[1::2]))
        return all(states.get(n) == "idle" for n in NODES)

    def _kill_leftover_job_processes(self) -> None:
        """slurmstepd processes of a killed slurmd (none in a clean run) die with it here."""
        if not self.dir:
            return
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if f"SLURM_CONF={self.conf}".encode() in env.split(b"\0") and int(pid) != os.getpid():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # -- helpers -----------------------------------------------------------------------------
    def _run(self, cmd: list[str], timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=timeout, **kw
        )

    def _wait_for(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            for proc in self.procs:
                if proc.poll() is not None:
                    raise SlurmUnavailable(
                        f"{proc.args[0]} exited ({proc.returncode}) while "
                        f"waiting for {what}:\n{self.logs()}"
                    )
            time.sleep(0.2)
        raise SlurmUnavailable(f"timed out waiting for {what}:\n{self.logs()}")

    def read(self, name: str) -> str:
        try:
            with open(os.path.join(self.dir, name), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def logs(self) -> str:
        names = ["munged.log", "slurmctld.log", "slurmctld.out"] + [
            f"slurmd.{n}.{ext}" for n in NODES for ext in ("log", "out")
        ]
        return "\n".join(f"--- {n}\n{self.read(n)[-3000:]}" for n in names)

    # -- jobs --------------------------------------------------------------------------------
    def sbatch(self, args: list[str], env: dict | None = None, cwd: str | None = None) -> str:
        done = subprocess.run(
            ["sbatch", "--parsable", *args],
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {done.stderr}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """scontrol's fields of the job (JobState, RestartCnt, ExitCode, Reason, ...)."""
        out = self._run(["scontrol", "-o", "show", "job", job_id]).stdout
        fields = {}
        for token in out.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "UNKNOWN")

    def wait(
        self,
        job_id: str,
        states: Iterable[str] = FINAL_STATES,
        timeout: float = 300,
        poll: float = 0.5,
    ) -> dict[str, str]:
        """Wait until the job is in one of states; returns its fields."""
        states = set(states)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(poll)
        raise TimeoutError(
            f"job {job_id} not in {sorted(states)} after {timeout} s: "
            f"{self.job(job_id)}\n{self.logs()}"
        )

    def scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return self._run(["scontrol", *args])

    def scancel(self, *args: str) -> subprocess.CompletedProcess:
        return self._run(["scancel", *args])

    @staticmethod
    def task_pids(job_id: str, procid: int, program: str) -> list[int]:
        """PIDs of the job's task SLURM_PROCID=procid running `program` (a python script)."""
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = set(f.read().split(b"\0"))
            except OSError:
                continue
            if (
                os.path.basename(argv[0]).startswith(b"python")
                and program.encode() in argv
                and f"SLURM_JOB_ID={job_id}".encode() in env
                and f"SLURM_PROCID={procid}".encode() in env
            ):
                pids.append(int(pid))
        return pids


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # stop the cluster on kill too
    with SlurmCluster() as c:
        print(f"export SLURM_CONF={c.conf}   # Ctrl-C stops the cluster", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
