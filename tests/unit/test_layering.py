"""Dependencies point one way, so that each part can be read, run and tested without the ones above
it:

- components and schedulers use the app, never the reverse, so the app runs (and is tested)
  without TorchX's component and scheduler layers;
- the app imports neither the benchmarks nor the tests nor what they share (testing/), and the
  benchmarks never import the tests (what both need lives in testing/);
- apps/core/ holds what every app shares (common/, launch/, checkpoint/, training/, the shared
  config sections, options, URLs) and imports no app, nor names one in its code (its docstrings
  and comments may): an app hands core its name with the rest of what is its own (its AppSpec);
  apps/dlrm/ and apps/hstu/ are apps on top of it, and neither imports the other;
- the rooms: common/ imports nothing else from the apps; data/ (each app's) imports neither
  launch/ nor the checkpoints nor the model (which builds on it), and the Criteo room, which the
  configuration reads, not the configuration; apps/core/data.py, which every data room imports,
  loads no torch; training/ (core's and each app's) builds on data/ and checkpoint/; launch/ does
  not import data/; serving/ (export and prediction) builds on the model, the data and the
  checkpoints, not on training, and only the commands above it import it.
"""

import ast
import pathlib
import re

import pytest

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

REPO = pathlib.Path(__file__).resolve().parents[2]
#: Packages above the app: what builds and submits jobs.
ABOVE_THE_APP = ("components", "schedulers", "torchx_plugins")
#: What measures and checks the app, and what those share: the app never needs them to run.
BESIDE_THE_APP = ("benchmarks", "tests", "testing")
DLRM = REPO / "apps" / "dlrm"
HSTU = REPO / "apps" / "hstu"
#: What every app shares: processes, launching, checkpoints, training, options (apps/core/).
CORE = REPO / "apps" / "core"
#: The training rooms: the shared Trainer and what each app plugs into it.
TRAINING = ("apps.core.training", "apps.dlrm.training", "apps.hstu.training")


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, absolute (a relative import resolved against its package),
    wherever the import stands (inside functions and ``if TYPE_CHECKING:`` too). For
    ``from a.b import c`` both ``a.b`` and ``a.b.c`` count, as ``c`` may be a module."""
    package = list(path.relative_to(REPO).with_suffix("").parts)[:-1]
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            modules.add(module)
            modules.update(f"{module}.{alias.name}" for alias in node.names)
    return modules


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def assert_imports_none(path: pathlib.Path, *packages: str, allowed: tuple[str, ...] = (), fix: str) -> None:
    """Fails, naming what and saying ``fix``, if ``path`` imports from ``packages`` (dotted names)
    anything that does not lie within ``allowed``."""
    found = sorted(
        m
        for m in imported_modules(path)
        if any(within(m, p) for p in packages) and not any(within(m, a) for a in allowed)
    )
    assert not found, f"{path.relative_to(REPO)} imports {found}: {fix}"


def sources(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(folder.rglob("*.py"))


def name(path: pathlib.Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("path", sources(REPO / "apps"), ids=name)
def test_the_app_imports_nothing_above_it(path):
    assert_imports_none(path, *ABOVE_THE_APP, fix="move what it needs under apps/")


@pytest.mark.parametrize("path", sources(REPO / "apps"), ids=name)
def test_the_app_imports_no_benchmark_test_or_test_helper(path):
    fix = "the app must run without the benchmarks and the tests; move what it needs under apps/"
    assert_imports_none(path, *BESIDE_THE_APP, fix=fix)


@pytest.mark.parametrize("path", sources(REPO / "benchmarks"), ids=name)
def test_the_benchmarks_import_no_test(path):
    assert_imports_none(path, "tests", fix="the tests import the benchmarks; move what both use to testing/")


#: The apps built on apps/core/.
APPS = ("apps.dlrm", "apps.hstu")


@pytest.mark.parametrize("path", sources(CORE), ids=name)
def test_core_imports_no_app(path):
    fix = (
        "apps/core/ is what every app shares: an app hands it what is its own (its config's "
        "model signature, its tables' TableModule, a TrainingApp) instead of core importing the app"
    )
    assert_imports_none(path, *APPS, fix=fix)


#: What names an app (case-insensitive): the apps' names and the DLRM's own data set.
APP_NAMES = re.compile(r"dlrm|hstu|criteo", re.IGNORECASE)


def app_names_in(source: str) -> list[str]:
    """Each identifier and string of the Python ``source`` that names an app (:data:`APP_NAMES`),
    as ``line: text``. Docstrings (and any string standing alone as a statement) and comments
    are prose, not code, and may."""
    tree = ast.parse(source)
    prose = {
        id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            texts = [node.value]
        elif isinstance(node, ast.alias):
            texts = [node.name, node.asname or ""]
        else:
            texts = [
                getattr(node, field) or "" for field in ("id", "attr", "name", "arg", "module") if hasattr(node, field)
            ]
        found += [f"{node.lineno}: {text!r}" for text in texts if isinstance(text, str) and APP_NAMES.search(text)]
    return found


@pytest.mark.parametrize("path", sources(CORE), ids=name)
def test_core_names_no_app(path):
    found = app_names_in(path.read_text())
    assert not found, (
        f"{name(path)} names an app in its code ({', '.join(found)}): apps/core/ is what every app shares; "
        "take the name from the app (its AppSpec, its TrainingApp), or say it in a docstring or comment"
    )


@pytest.mark.parametrize(
    "planted, found",
    [
        ('logger = logging.getLogger("apps.dlrm")', "apps.dlrm"),  # a string
        ('prog = f"python -m apps.HSTU.{command}"', "python -m apps.HSTU."),  # an f-string's text, any case
        ("def criteo_rows(path): ...", "criteo_rows"),  # a function's name
        ("rows = data.criteo", "criteo"),  # an attribute
        ("from apps.core.training.app_spec import AppSpec as DlrmSpec", "DlrmSpec"),  # an import's name
        ("run(app=hstu)", "hstu"),  # a name
    ],
)
def test_the_check_finds_an_app_named_in_core_code(planted, found):
    """The rule holds only if its check fails on a violation: one planted in a source of core's."""
    assert app_names_in(planted) == [f"1: {found!r}"]
    source = (CORE / "config.py").read_text()
    assert app_names_in(source) == [] and app_names_in(source + "\n" + planted) != []


def test_the_check_leaves_prose_alone():
    prose = """\"\"\"The DLRM's run.\"\"\"


class Folder:
    \"\"\"Criteo's days.\"\"\"

    rows = 1  # as the HSTU counts them
    \"\"\"hstu: an attribute's docstring.\"\"\"
"""
    assert app_names_in(prose) == []


@pytest.mark.parametrize("path", sources(REPO / "apps" / "hstu"), ids=name)
def test_hstu_does_not_import_dlrm(path):
    fix = "the apps are siblings on apps/core/: move what both need into apps/core/"
    assert_imports_none(path, "apps.dlrm", fix=fix)


@pytest.mark.parametrize("path", sources(CORE / "common"), ids=name)
def test_common_imports_nothing_else_from_the_app(path):
    fix = (
        "apps/core/common/ is what every room shares, so it builds on the standard library and "
        "third-party packages only; move the code that needs more out of common/"
    )
    assert_imports_none(path, "apps", allowed=("apps.core.common",), fix=fix)


#: The apps' data rooms.
DATA_SOURCES = sources(DLRM / "data") + sources(HSTU / "data")


@pytest.mark.parametrize("path", DATA_SOURCES, ids=name)
def test_the_data_sources_import_neither_launch_nor_checkpoints(path):
    fix = (
        "a data source is handed what it needs (its app's model and data sections, a RankShare "
        "from apps.core.data) and knows neither how the job was launched nor how it is saved"
    )
    assert_imports_none(path, "apps.core.launch", "apps.core.checkpoint", fix=fix)


@pytest.mark.parametrize("path", DATA_SOURCES, ids=name)
def test_the_data_sources_do_not_import_the_model(path):
    fix = "the model builds on the data (its batches, its features' names), not the reverse: move the shared piece into data/"
    assert_imports_none(path, "apps.dlrm.model", "apps.hstu.model", fix=fix)


@pytest.mark.parametrize("path", sources(DLRM / "data" / "criteo"), ids=name)
def test_the_criteo_room_does_not_import_the_configuration(path):
    fix = (
        "the configuration reads the Criteo tables (apps/dlrm/data/criteo/tables.py), so the Criteo "
        "room lies below it: type a section by what the code reads of it (a Protocol), as the loader does"
    )
    assert_imports_none(path, "apps.dlrm.config", fix=fix)


def test_the_shared_data_protocol_loads_no_torch():
    fix = (
        "apps/core/data.py is imported while an app's configuration is read (the DLRM's reads its "
        "data package), which must not load torch: keep torch to the sources"
    )
    assert_imports_none(CORE / "data.py", "torch", "torchrec", "fbgemm_gpu", "numpy", "pyarrow", fix=fix)


@pytest.mark.parametrize("path", sources(CORE / "launch"), ids=name)
def test_launch_does_not_import_the_data_sources(path):
    fix = "starting a job must not load the data sources; move what both need to apps/core/common/"
    assert_imports_none(path, "apps.dlrm.data", fix=fix)


@pytest.mark.parametrize("path", DATA_SOURCES + sources(CORE / "checkpoint"), ids=name)
def test_data_and_checkpoints_do_not_import_training(path):
    fix = (
        "the training room (apps/core/training/, an app's training/) builds on the data sources and "
        "the checkpoints, not the reverse: hand them what they need, or move the shared piece below both"
    )
    assert_imports_none(path, *TRAINING, fix=fix)


@pytest.mark.parametrize("path", sources(CORE / "launch"), ids=name)
def test_launch_imports_neither_training_nor_checkpoints(path):
    fix = "shaping and starting a job must not load the training machinery; move what both need to common/"
    assert_imports_none(path, *TRAINING, "apps.core.checkpoint", fix=fix)


@pytest.mark.parametrize("path", sources(DLRM / "serving"), ids=name)
def test_serving_builds_on_the_model_data_and_checkpoints_not_on_training(path):
    fix = (
        "exporting and scoring load a checkpoint whole in one process: they need the model, the data "
        "sources and the checkpoints, not the training run's machinery (move what both need below both)"
    )
    assert_imports_none(path, *TRAINING, "apps.core.launch", fix=fix)


@pytest.mark.parametrize("path", [p for p in sources(DLRM) if "serving" not in p.parts], ids=name)
def test_only_the_serving_commands_import_serving(path):
    if path.parent == DLRM and path.stem in ("export", "predict"):
        return  # python -m apps.dlrm.export / predict
    fix = "training, data and checkpoints must not depend on what is made of their results"
    assert_imports_none(path, "apps.dlrm.serving", fix=fix)
