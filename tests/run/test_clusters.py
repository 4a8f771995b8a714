"""Profiles against clusters that conveyor does not own: Slurm job scripts, TLS schedulers."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from distributed import LocalCluster
from distributed.security import Security

from conveyor.errors import ProfileError, SpecError
from conveyor.run.profiles import Profiles, slurm_cluster
from conveyor.spec.models import Pipeline
from conveyor.spec.profiles import DaskProfile, SlurmProfile


def test_slurm_profile_generates_the_job_script_it_declares() -> None:
    profile = SlurmProfile(kind="slurm", queue="gpu", account="ml-team", cores=8, memory="32GiB",
                           walltime="02:00:00", processes=2, job_extra=("--gres=gpu:1", "--constraint=a100"),
                           resources={"GPU": 1})
    with slurm_cluster("hpc", profile) as cluster:
        script = cluster.job_script()
    assert "--resources GPU=1" in script  # what a stage's resources: {GPU: 1} holds
    assert "#SBATCH -J conveyor-hpc" in script
    assert "#SBATCH -p gpu" in script
    assert "#SBATCH -A ml-team" in script
    assert "#SBATCH -n 1" in script and "#SBATCH --cpus-per-task=8" in script
    assert "#SBATCH --mem=32G" in script
    assert "#SBATCH -t 02:00:00" in script
    assert "#SBATCH --gres=gpu:1" in script and "#SBATCH --constraint=a100" in script
    assert "--nworkers 2" in script and "--nthreads 4" in script


def test_a_slurm_profile_starts_in_a_thread_and_leaves_ctrl_c_to_conveyor() -> None:
    """dask_jobqueue sets SIGINT to sys.exit as it is imported, which fails in the thread a profile
    starts in; in a fresh interpreter, as `conveyor run` imports it."""
    script = textwrap.dedent("""
        import signal, threading
        from conveyor.run.profiles import slurm_cluster
        from conveyor.spec.profiles import SlurmProfile

        def ours(signum, frame): pass
        signal.signal(signal.SIGINT, ours)
        failed = []
        def start():
            try:
                with slurm_cluster("hpc", SlurmProfile(kind="slurm")) as cluster:
                    assert "#SBATCH -J conveyor-hpc" in cluster.job_script()
            except Exception as exc:
                failed.append(exc)
        thread = threading.Thread(target=start)
        thread.start()
        thread.join()
        assert not failed, failed
        assert signal.getsignal(signal.SIGINT) is ours
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_address_and_local_cluster_options_are_exclusive() -> None:
    with pytest.raises(SpecError, match="'address' connects to an existing cluster: n_workers only apply"):
        from conveyor.spec.parse import parse_pipeline
        from conveyor.spec.yamlmap import LoadedYaml

        parse_pipeline(LoadedYaml(Path("spec.yaml"), {
            "pipeline": "x", "stages": {"a": {"task": "tasks.x:y"}},
            "profiles": {"remote": {"kind": "dask", "address": "tcp://127.0.0.1:1", "n_workers": 2}}}))


def _certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, used as its own CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(__import__("ipaddress").ip_address(
                "127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


@pytest.mark.slow
def test_tls_scheduler_with_security_files(tmp_path: Path) -> None:
    cert, key = _certificate(tmp_path)
    security = Security(tls_ca_file=str(cert), tls_scheduler_cert=str(cert), tls_scheduler_key=str(key),
                        tls_worker_cert=str(cert), tls_worker_key=str(key), tls_client_cert=str(cert),
                        tls_client_key=str(key), require_encryption=True)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, protocol="tls://", host="127.0.0.1",
                      security=security, dashboard_address="127.0.0.1:0") as cluster:
        assert cluster.scheduler_address.startswith("tls://")
        pipeline = Pipeline.model_validate({
            "pipeline": "tls", "stages": {"a": {"task": "tasks.x:y", "on": "remote"}},
            "profiles": {"remote": {"kind": "dask", "address": cluster.scheduler_address,
                                    "security": {"ca_file": str(cert), "cert": str(cert), "key": str(key)}}}})
        with Profiles(pipeline.profiles) as profiles:
            client = profiles.get("remote").client
            assert client is not None
            assert client.submit(sum, [1, 2, 3]).result(timeout=30) == 6
        plain = DaskProfile(kind="dask", address=cluster.scheduler_address)
        with Profiles({"plain": plain}) as profiles, pytest.raises(
                ProfileError, match=r"profile 'plain': cannot connect .* needs 'security: \{ca_file, cert, key\}'"):
            profiles.get("plain")
