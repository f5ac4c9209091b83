"""One OpenMP thread, passive wait, for the tests that compute in the pytest process itself, set before anything
imports torch. CI runs plain `python -m pytest` (nothing sets OMP_NUM_THREADS): torch then takes a thread per
core with busy-waiting workers, and on the 2-core box a tiny MoE forward+backward measured 4.5 s per step against
0.15 s with one thread (dense: 2.8 s vs 0.09 s; a loaded box, so the ratio is rough). The launches the tests
start set their own threads (helpers.child_env; train.sh when the variable is unset, which test_e2e checks)."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("VEOMNI_LOSS_PLOT", "0")  # no loss.png (matplotlib: a CPU-second per run) unless a test asks
# Every temporary file of the session, the launches' included (they inherit TMPDIR: torchrun's, multiprocessing's,
# the checks' scratch models, pytest's own tmp_path), goes under one folder removed when the session ends. A suite
# run writes several GB; left in /tmp they filled CI's disk ("No space left on device") after a few runs.
# pytest-xdist's workers share the folder of the process that started them (one level deep: the launches'
# AF_UNIX socket paths stay short). Inductor keeps its usual cache of compiled kernels across runs.
SCRATCH = os.environ.get("VEOMNI_TEST_SCRATCH")
if SCRATCH is None:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "torchinductor_tests"))
    SCRATCH = os.environ["VEOMNI_TEST_SCRATCH"] = tempfile.mkdtemp(prefix="veomni-tests-")
    # Removed at exit, not at pytest_unconfigure: the exit handlers registered later (helpers' launch servers,
    # multiprocessing's own `pymp-` folders, whose removal prints a FileNotFoundError traceback when they are gone)
    # run first; by this process only (a forked child that exits normally runs its parent's handlers too)
    OWNER = os.getpid()
    atexit.register(lambda: os.getpid() == OWNER and shutil.rmtree(SCRATCH, ignore_errors=True))
os.environ["TMPDIR"] = tempfile.tempdir = SCRATCH
# the data caches of mapping datasets (veomni/data/sample_cache.py) go there too, not to the user's ~/.cache
os.environ.setdefault("VEOMNI_DATA_CACHE", os.path.join(SCRATCH, "data-cache"))

import faulthandler  # noqa: E402
import glob  # noqa: E402

import pytest  # noqa: E402

# A process forked from this one (a DataLoader worker) that dies of a fatal signal dumps its Python stack into its
# own file, and a failing test's report shows the dumps written while it ran: pytest's faulthandler writes them to
# the worker's stderr, far from the failure, and CI's summary cuts it (an abort in a loader worker was seen there
# twice with nothing but "killed by signal: Aborted" left to read).
FAULTS = os.path.join(SCRATCH, "faults", str(os.getpid()))
os.makedirs(FAULTS, exist_ok=True)
_PYTEST_PID, _fault_file = os.getpid(), []


def _dump_faults_to_a_file():
    if os.getppid() == _PYTEST_PID:  # this process's own children only, not the processes they fork
        _fault_file[:] = [open(os.path.join(FAULTS, f"{os.getpid()}.txt"), "w")]
        faulthandler.enable(_fault_file[0], all_threads=True)


os.register_at_fork(after_in_child=_dump_faults_to_a_file)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    for path in sorted(glob.glob(os.path.join(FAULTS, "*.txt"))):
        if os.path.getsize(path):  # empty: a child that did not crash
            with open(path) as f:
                report.sections.append((f"fatal error in forked child {os.path.basename(path)[:-4]}", f.read()))
            os.remove(path)


# The longest files first: README's test command spreads files over two pytest workers (pytest-xdist, --dist
# loadfile), and a long file dealt out last would leave one worker running it alone at the end. Rough order of
# their measured durations on the 2-core box; every other file keeps collection order after them.
LONGEST_FIRST = (
    "test_lifecycle.py", "test_checkpoint.py", "test_tensor_parallel.py", "test_verify.py", "test_gpu_speed.py",
    "test_e2e.py", "test_lora.py", "test_dpo_train.py", "test_plan.py", "test_hf_checkpoints.py", "test_vlm_demo.py",
    "test_ulysses.py", "test_parity_data_parallel.py", "test_verl_engine.py", "test_hub.py", "test_reliability.py",
    "test_muon_distributed.py", "test_sft_traps.py", "test_evaluation.py", "test_kernels.py",
    "test_expert_parallel.py", "test_compile_structure.py", "test_sft_demo.py", "test_first_hour.py", "test_chat.py",
    "test_gpu_mfu.py", "test_export_memory.py", "test_moe.py", "test_sample_cache.py", "test_vlm_parallel.py",
    "test_fp8.py",
)  # fmt: skip


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: tests keep their order in a file


@pytest.fixture
def one_process_group():
    """A gloo process group of one, in this process (no torchrun), for collective code a test runs in place (the
    Checkpointer, FSDP2 on one rank). A group already started is reused and left running."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


# Real media and real processor folders for the multimodal data tests: built once per session (the 151k-token Qwen
# tokenizer loads in seconds) and shared by test_multimodal_data.py and test_multimodal_collate.py.
@pytest.fixture(scope="session")
def mm_assets(tmp_path_factory):
    from PIL import Image

    from veomni.data.multimodal import demo_data

    root = tmp_path_factory.mktemp("mm")
    images = demo_data.skimage_images()
    vqa = demo_data.easy_vqa("test")[:3]
    speech = "The cat sat on the mat."
    wav = demo_data.write_speech_wav(speech, str(root / "speech.wav"))
    astronaut = Image.open(images["astronaut"]["path"]).convert("RGB")
    frames = [str(root / f"frame{i}.png") for i in range(3)]  # a camera pan over the astronaut photo
    for i, path in enumerate(frames):
        astronaut.crop((40 * i, 0, 40 * i + 256, 192)).save(path)
    return {"root": root, "images": images, "vqa": vqa, "wav": wav, "speech": speech, "frames": frames}


@pytest.fixture(scope="session")
def mm_processors(mm_assets):
    """Real processor folders built from the npm Qwen tokenizer, saved, and loaded back with build_processor."""
    from veomni.data.multimodal.processor_builder import build_qwen_processor_folder
    from veomni.models import build_processor

    root = mm_assets["root"]
    return {
        kind: build_processor(build_qwen_processor_folder(kind, str(root / folder), max_pixels=48 * patch * patch))
        for kind, folder, patch in (("qwen2_5_vl", "vl", 28), ("qwen3_vl", "vl3", 32), ("qwen2_5_omni", "omni", 28))
    }
