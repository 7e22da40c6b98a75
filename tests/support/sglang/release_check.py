"""What the plugin relies on in an SGLang release, checked by reading the wheel's source.

Nothing here imports SGLang (its wheel needs CUDA libraries): the wheel is a zip file, its modules
are parsed with `ast`. `problems(wheel)` lists every name the plugin needs that the release lacks
or has changed, each as "<dotted name>: <what is wrong>"; an empty list means the release fits.
"""

from __future__ import annotations

import ast
import dataclasses
import email.parser
import re
import sys
import zipfile
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

from hsx_sglang import plugin
from hsx_sglang.settings import DEFAULT_RID_PREFIX
from tests.support.sglang import standins

PLUGIN_PACKAGE = Path(plugin.__file__).resolve().parent
README = PLUGIN_PACKAGE.parent / "README.md"

# The objects the plugin reads, by the stand-ins that the hook's tests build.
STANDINS = (
    standins.Req,
    standins.ScheduleBatch,
    standins.LogitsProcessorOutput,
    standins.GenerationBatchResult,
    standins.ModelConfig,
    standins.ExecFeatures,
    standins.Parallel,
    standins.SchedulerBatchResultProcessor,
)


class WheelSource:
    """The Python modules of an SGLang wheel, parsed on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._zip = zipfile.ZipFile(self.path)
        self._names = set(self._zip.namelist())
        self._trees: dict[str, ast.Module | None] = {}

    def close(self) -> None:
        self._zip.close()

    def file_of(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for name in (f"{base}.py", f"{base}/__init__.py"):
            if name in self._names:
                return name
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            name = self.file_of(module)
            self._trees[module] = None if name is None else ast.parse(self._zip.read(name), filename=name)
        return self._trees[module]

    def files_under(self, folder: str) -> Iterator[str]:
        return (n for n in sorted(self._names) if n.startswith(folder) and n.endswith(".py"))

    def text(self, module: str) -> str:
        """A module's source, empty when the wheel lacks it."""
        name = self.file_of(module)
        return "" if name is None else self._zip.read(name).decode()

    def parse_file(self, name: str) -> ast.Module:
        return ast.parse(self._zip.read(name), filename=name)

    def imports(self, module: str) -> bool:
        """Whether some module of sglang.srt imports `module` (or one of its submodules)."""
        pattern = re.compile(rb"^\s*(?:import|from)\s+" + re.escape(module.encode()) + rb"[\s.]", re.M)
        return any(pattern.search(self._zip.read(n)) for n in self.files_under("sglang/srt/"))

    @cached_property
    def metadata(self) -> dict[str, list[str]]:
        meta_name = next(n for n in self._names if n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(self._zip.read(meta_name).decode())
        return {key: message.get_all(key) or [] for key in ("Name", "Version", "Requires-Dist")}

    @property
    def version(self) -> str:
        return self.metadata["Version"][0]


def problems(wheel: Path) -> list[str]:
    src = WheelSource(wheel)
    try:
        found: list[str] = []
        for check in (
            _plugin_loader,
            _hook_registry,
            _hook_targets,
            _standin_attributes,
            _runtime_context,
            _aux_capture,
            _extend_lengths,
            _full_capture,
            _health_check_rid,
            _launch_flags,
            _imports,
            _service_requests,
            _answers,
        ):
            found.extend(check(src))
        return found
    finally:
        src.close()


# ---------------------------------------------------------------------------------------------
# the checks


def _plugin_loader(src: WheelSource) -> list[str]:
    out: list[str] = []
    mod = "sglang.srt.plugins"
    tree = src.tree(mod)
    if tree is None:
        return [f"{mod}: module missing (no plugin mechanism)"]
    if _module_constant(tree, "GENERAL_PLUGINS_GROUP") != "sglang.srt.plugins":
        out.append(f"{mod}.GENERAL_PLUGINS_GROUP: is not 'sglang.srt.plugins' (the entry-point group)")
    load = _function(tree, "load_plugins")
    if load is None:
        out.append(f"{mod}.load_plugins: missing")
    elif "HookRegistry.apply_hooks()" not in _calls(load):
        out.append(f"{mod}.load_plugins: does not call HookRegistry.apply_hooks()")
    if "SGLANG_PLUGINS" not in {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}:
        out.append(f"{mod}: does not read SGLANG_PLUGINS")
    environ = src.tree("sglang.srt.environ")
    if environ is None or not any(
        isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SGLANG_PLUGINS" for t in n.targets)
        for n in ast.walk(environ)
    ):
        out.append("sglang.srt.environ.SGLANG_PLUGINS: missing")
    for launcher in ("sglang.launch_server", "sglang.srt.managers.scheduler"):
        tree = src.tree(launcher)
        if tree is None or "load_plugins()" not in _calls(tree):
            out.append(f"{launcher}: does not call load_plugins()")
    return out


def _hook_registry(src: WheelSource) -> list[str]:
    mod = "sglang.srt.plugins.hook_registry"
    tree = src.tree(mod)
    if tree is None:
        return [f"{mod}: module missing"]
    out: list[str] = []
    registry = _class(tree, "HookRegistry")
    if registry is None:
        return [f"{mod}.HookRegistry: missing"]
    register = _method(registry, "register")
    if register is None or "classmethod" not in _decorators(register):
        out.append(f"{mod}.HookRegistry.register: missing or not a classmethod")
    elif _signature(register) != "(cls, target, hook, hook_type=HookType.AFTER, *, source=None)":
        out.append(f"{mod}.HookRegistry.register: signature is now {_signature(register)}")
    hook_type = _class(tree, "HookType")
    members = set() if hook_type is None else _assigned_names(hook_type)
    for member in ("AFTER", "AROUND"):
        if member not in members:
            out.append(f"{mod}.HookType.{member}: missing")
    wrap = _function(tree, "_wrap_fn")
    calls = set() if wrap is None else _calls(wrap)
    for call, meaning in (
        ("hook(original_fn, *args, **kwargs)", "AROUND hooks get (original, *args, **kwargs)"),
        ("hook(result, *args, **kwargs)", "AFTER hooks get (result, *args, **kwargs)"),
    ):
        if call not in calls:
            out.append(f"{mod}._wrap_fn: does not call {call} ({meaning})")
    apply = _method(registry, "_apply_target")
    if apply is None or not {"pkgutil.resolve_name(obj_path)", "setattr(obj, attr_name, wrapped)"} <= _calls(apply):
        out.append(f"{mod}.HookRegistry._apply_target: does not resolve the dotted path and sets the attribute")
    return out


def _hook_targets(src: WheelSource) -> list[str]:
    out: list[str] = []
    module, cls_name = plugin.PROCESSOR_CLASS.rsplit(".", 1)
    tree = src.tree(module)
    if tree is None:
        return [f"{module}: module missing"]
    cls = _class(tree, cls_name)
    if cls is None:
        return [f"{plugin.PROCESSOR_CLASS}: missing"]
    if _method(cls, "__init__") is None and not any(d.startswith("dataclass") for d in _decorators(cls)):
        out.append(f"{plugin.INIT_TARGET}: neither defined nor made by @dataclass")
    prefill_name = plugin.PREFILL_TARGET.rsplit(".", 1)[1]
    prefill = _method(cls, prefill_name)
    if prefill is None:
        return [*out, f"{plugin.PREFILL_TARGET}: missing"]
    if _signature(prefill) != "(self, batch, result)":
        out.append(f"{plugin.PREFILL_TARGET}: signature is now {_signature(prefill)}")
    body = ast.unparse(prefill)
    for needed, why in (
        ("result.copy_done.synchronize()", "the hook queues dumps after SGLang waited for the batch's results"),
        ("req.inflight_middle_chunks -= 1", "the hook reads the chunk counter before SGLang lowers it"),
        ("result.extend_input_len_per_req", "rows per request"),
        ("result.logits_output", "the hidden states"),
    ):
        if needed not in body:
            out.append(f"{plugin.PREFILL_TARGET}: does not contain `{needed}` ({why})")
    return out


def _standin_attributes(src: WheelSource) -> list[str]:
    out: list[str] = []
    for standin in STANDINS:
        module, cls_name = standin.SGLANG_CLASS.rsplit(".", 1)
        tree = src.tree(module)
        cls = None if tree is None else _class(tree, cls_name)
        if tree is None or cls is None:
            out.append(f"{standin.SGLANG_CLASS}: missing")
            continue
        have = _class_attributes(tree, cls)
        wanted = [f.name for f in dataclasses.fields(standin)]
        wanted += [n for n, v in vars(standin).items() if callable(v) and not n.startswith("_")]
        out += [f"{standin.SGLANG_CLASS}.{name}: missing" for name in wanted if name not in have]
    return out


def _runtime_context(src: WheelSource) -> list[str]:
    mod = "sglang.srt.runtime_context"
    tree = src.tree(mod)
    if tree is None:
        return [f"{mod}: module missing"]
    out = [f"{mod}.{fn}: missing" for fn in ("get_exec", "get_parallel") if _function(tree, fn) is None]
    # get_exec().features and get_parallel() are the namespaces these classes declare
    for standin, ns_path in ((standins.ExecFeatures, "exec.features"), (standins.Parallel, "parallel")):
        module, cls_name = standin.SGLANG_CLASS.rsplit(".", 1)
        fields = src.tree(module)
        cls = None if fields is None else _class(fields, cls_name)
        if cls is not None and _class_constant(cls, "_NS_PATH") != ns_path:
            out.append(f"{standin.SGLANG_CLASS}._NS_PATH: is not {ns_path!r}")
    return out


def _aux_capture(src: WheelSource) -> list[str]:
    out: list[str] = []
    mod = "sglang.srt.arg_groups.validation_hook"
    tree = src.tree(mod)
    handler = None if tree is None else _function(tree, "handle_aux_hidden_state_capture")
    if tree is None or handler is None:
        out.append(f"{mod}.handle_aux_hidden_state_capture: missing (no --enable-return-aux-hidden-states)")
    else:
        methods = _module_constant(tree, "_AUX_HIDDEN_STATE_CAPTURE_METHODS")
        if not isinstance(methods, tuple) or "EAGLE3" not in methods:
            out.append(f"{mod}._AUX_HIDDEN_STATE_CAPTURE_METHODS: does not hold EAGLE3")
        if "aux_hidden_state_capture=method.lower()" not in ast.unparse(handler):
            out.append(
                f"{mod}.handle_aux_hidden_state_capture: does not record the method lower-cased "
                f"(the plugin expects {plugin.AUX_CAPTURE_METHOD!r})"
            )
    llama = src.tree("sglang.srt.models.llama")
    causal = None if llama is None else _class(llama, "LlamaForCausalLM")
    setter = None if causal is None else _method(causal, "set_eagle3_layers_to_capture")
    if setter is None:
        out.append("sglang.srt.models.llama.LlamaForCausalLM.set_eagle3_layers_to_capture: missing")
    else:
        text = ast.unparse(setter)
        for needed in ("[2, num_layers // 2, num_layers - 3]", "[val + 1 for val in layer_ids]"):
            if needed not in text:
                out.append(
                    "sglang.srt.models.llama.LlamaForCausalLM.set_eagle3_layers_to_capture: "
                    f"not `{needed}` (the layer numbering of hsx_sglang.layers)"
                )
    model = None if llama is None else _class(llama, "LlamaModel")
    forward = None if model is None else _method(model, "forward")
    if forward is None or "i in self.layers_to_capture" not in ast.unparse(forward):
        out.append("sglang.srt.models.llama.LlamaModel.forward: does not capture in layer order")
    logits = src.tree("sglang.srt.layers.logits_processor")
    if logits is None or "pack_aux_hidden_states(aux_hidden_states)" not in ast.unparse(logits):
        out.append("sglang.srt.layers.logits_processor: does not pack the aux layers side by side")
    return out


def _extend_lengths(src: WheelSource) -> list[str]:
    """The scheduler fills extend_input_len_per_req for batches that return logprobs (or hidden states):
    hsx's requests to the plugin ask for logprobs."""
    tree = src.tree("sglang.srt.managers.scheduler")
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.If) and "return_logprob" in ast.unparse(node.test):
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr == "extend_input_len_per_req" for t in stmt.targets
                ):
                    return []
    return ["sglang.srt.managers.scheduler: does not set extend_input_len_per_req for batches returning logprobs"]


def _full_capture(src: WheelSource) -> list[str]:
    """Aux capture makes the server capture every token (mode full)."""
    out = []
    hook = src.tree("sglang.srt.arg_groups.serving_hook")
    handler = None if hook is None else _function(hook, "handle_return_hidden_states_mode")
    text = "" if handler is None else ast.unparse(handler)
    if "cfg.enable_return_aux_hidden_states" not in text or "return_hidden_states_mode='full'" not in text:
        out.append(
            "sglang.srt.arg_groups.serving_hook.handle_return_hidden_states_mode: "
            "--enable-return-aux-hidden-states does not set the hidden-states mode to full"
        )
    return out


def _health_check_rid(src: WheelSource) -> list[str]:
    tree = src.tree("sglang.srt.constants")
    prefix = None if tree is None else _module_constant(tree, "HEALTH_CHECK_RID_PREFIX")
    if not isinstance(prefix, str):
        return ["sglang.srt.constants.HEALTH_CHECK_RID_PREFIX: missing"]
    if prefix.startswith(DEFAULT_RID_PREFIX):
        return [f"sglang.srt.constants.HEALTH_CHECK_RID_PREFIX: {prefix!r} starts with hsx's {DEFAULT_RID_PREFIX!r}"]
    return []


def _launch_flags(src: WheelSource) -> list[str]:
    have = cli_flags(src)
    return [f"sglang.launch_server {flag}: no such flag" for flag in readme_launch_flags() if flag not in have]


def _imports(src: WheelSource) -> list[str]:
    """The plugin imports nothing the model server does not already have: the standard library,
    SGLang, and modules that SGLang's own code imports."""
    out = []
    for path in sorted(PLUGIN_PACKAGE.glob("*.py")):
        for mod in sorted(_top_level_imports(ast.parse(path.read_text(encoding="utf-8")))):
            if mod in sys.stdlib_module_names or mod in ("hsx_sglang", "sglang") or src.imports(mod):
                continue
            out.append(f"hsx_sglang/{path.name} imports {mod}, which SGLang's code does not import")
    return out


# What hsx's service sends and reads (hsx.backends.sglang and its two engines in hsx.backends.engines).
REQUEST_FIELDS = ("input_ids", "rid", "extra_key", "return_hidden_states", "return_logprob", "sampling_params")
SERVER_INFO_FIELDS = (
    "--model-path",
    "--dtype",
    "--chunked-prefill-size",
    "--disable-radix-cache",
    "--enable-return-hidden-states",
    "--return-hidden-states-mode",
    "--enable-return-aux-hidden-states",
    "--return-aux-hidden-state-layer-ids",
)
ROUTES = ("/generate", "/health", "/get_model_info", "/get_server_info")
META_INFO_KEYS = ("id", "prompt_tokens", "cached_tokens", "hidden_states")


def _service_requests(src: WheelSource) -> list[str]:
    """The request fields hsx sends, the server arguments it reads from /get_server_info (server
    arguments are reported by field name, each field being a flag), and the routes it calls."""
    out = []
    io = src.tree("sglang.srt.managers.io_struct")
    cls = None if io is None else _class(io, "GenerateReqInput")
    if cls is None:
        return ["sglang.srt.managers.io_struct.GenerateReqInput: missing"]
    fields = _assigned_names(cls)
    out += [f"sglang.srt.managers.io_struct.GenerateReqInput.{f}: missing" for f in REQUEST_FIELDS if f not in fields]
    if 'f"{self.rid}_{i}"' not in ast.unparse(cls).replace("'", '"'):
        out.append("sglang.srt.managers.io_struct.GenerateReqInput: a batch's string rid no longer becomes {rid}_{i}")
    have = cli_flags(src)
    out += [f"sglang.launch_server {flag}: no such flag" for flag in SERVER_INFO_FIELDS if flag not in have]
    text = src.text("sglang.srt.entrypoints.http_server")
    out += [f"sglang.srt.entrypoints.http_server {r}: no such route" for r in ROUTES if f'"{r}"' not in text]
    if "result = server_args.resolved_dict()" not in src.text("sglang.srt.utils.common"):
        out.append("sglang.srt.utils.common.build_server_info: no longer reports the resolved server arguments")
    return out


def _answers(src: WheelSource) -> list[str]:
    """The answer's meta_info keys; a rid in flight refused; in mode full the prefill rows as one
    nested list, cut to the completion's length (so max_new_tokens 0 returns none)."""
    out = []
    text = src.text("sglang.srt.managers.tokenizer_manager")
    out += [
        f"sglang.srt.managers.tokenizer_manager meta_info[{k!r}]: not answered"
        for k in META_INFO_KEYS
        if f'"{k}"' not in text
    ]
    if "Duplicate request ID detected" not in text:
        out.append("sglang.srt.managers.tokenizer_manager: a rid in flight is no longer refused")
    processor = src.tree("sglang.srt.managers.scheduler_components.batch_result_processor")
    cls = None if processor is None else _class(processor, "SchedulerBatchResultProcessor")
    append = None if cls is None else _method(cls, "_append_prefill_hidden_states")
    if append is None or "req_hidden_states.cpu().clone().tolist()" not in ast.unparse(append):
        out.append(
            "SchedulerBatchResultProcessor._append_prefill_hidden_states: "
            "mode full no longer answers the prefill rows as one list"
        )
    streamer = src.tree("sglang.srt.managers.scheduler_components.output_streamer")
    if streamer is None or "hs = hs[:req.finished_len]" not in ast.unparse(streamer):
        out.append(
            "sglang.srt.managers.scheduler_components.output_streamer: hidden states no longer cut to finished_len"
        )
    return out


# ---------------------------------------------------------------------------------------------
# the launch command's flags


def readme_launch_flags() -> list[str]:
    """Every --flag of the launch commands in deploy/sglang/README.md's code blocks."""
    flags: list[str] = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S):
        command = block.replace("\\\n", " ")
        for line in command.splitlines():
            if "sglang.launch_server" in line:
                flags += [f for f in re.findall(r"(?<!\S)(--[a-z0-9][a-z0-9-]*)", line) if f not in flags]
    return flags


def cli_flags_of(wheel: Path) -> set[str]:
    """The flags `python -m sglang.launch_server` of this wheel accepts."""
    src = WheelSource(wheel)
    try:
        return cli_flags(src)
    finally:
        src.close()


def cli_flags(src: WheelSource) -> set[str]:
    """The flags `python -m sglang.launch_server` accepts: the annotated server-args fields (each
    `A[type, help]` or `A[type, Arg(...)]` becomes --field-name unless no_cli, plus aliases) and
    every explicit add_argument."""
    flags: set[str] = set()
    for name in [*src.files_under("sglang/srt/server_args.py"), *src.files_under("sglang/srt/arg_groups/")]:
        tree = src.parse_file(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                flags |= {_string(a) for a in node.args if _string(a).startswith("--")}
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        flags |= _field_flags(stmt.target.id, stmt.annotation)
    return flags


def _field_flags(field: str, annotation: ast.expr) -> set[str]:
    if not (
        isinstance(annotation, ast.Subscript)
        and isinstance(annotation.value, ast.Name)
        and annotation.value.id == "A"
        and isinstance(annotation.slice, ast.Tuple)
        and len(annotation.slice.elts) >= 2
    ):
        return set()
    meta = annotation.slice.elts[1]
    name = "--" + field.replace("_", "-")
    if isinstance(meta, (ast.Constant, ast.JoinedStr, ast.BinOp)):  # A[type, "help"]
        return {name}
    if isinstance(meta, ast.Call) and isinstance(meta.func, ast.Name) and meta.func.id == "Arg":
        kw = {k.arg: k.value for k in meta.keywords}
        no_cli = kw.get("no_cli")
        if isinstance(no_cli, ast.Constant) and no_cli.value is True:
            return set()
        cli_name = kw.get("cli_name")
        flags = {_string(cli_name) if cli_name is not None else name}
        aliases = kw.get("aliases")
        if isinstance(aliases, ast.List):
            flags |= {_string(a) for a in aliases.elts}
        return flags
    return set()


def _string(node: ast.expr) -> str:
    """A string literal's value, or "" for anything else."""
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""


# ---------------------------------------------------------------------------------------------
# ast helpers


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _decorators(node: ast.FunctionDef | ast.ClassDef) -> list[str]:
    return [ast.unparse(d) for d in node.decorator_list]


def _signature(fn: ast.FunctionDef) -> str:
    """Parameter names and defaults, without annotations: "(self, batch, result)"."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults))
    defaults += a.defaults
    parts = [p.arg if d is None else f"{p.arg}={ast.unparse(d)}" for p, d in zip(positional, defaults)]
    if a.vararg is not None:
        parts.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        parts.append("*")
    parts += [k.arg if d is None else f"{k.arg}={ast.unparse(d)}" for k, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg is not None:
        parts.append(f"**{a.kwarg.arg}")
    return f"({', '.join(parts)})"


def _calls(node: ast.AST) -> set[str]:
    return {ast.unparse(n) for n in ast.walk(node) if isinstance(n, ast.Call)}


def _assigned_names(node: ast.Module | ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, ast.Assign):
            names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
    return names


def _module_constant(tree: ast.Module, name: str) -> object:
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            try:
                return ast.literal_eval(stmt.value)
            except ValueError:
                return None
    return None


def _class_constant(cls: ast.ClassDef, name: str) -> object:
    return _module_constant(ast.Module(body=cls.body, type_ignores=[]), name)


def _class_attributes(tree: ast.Module, cls: ast.ClassDef) -> set[str]:
    """Fields, class attributes, methods and every `self.x = ...` of a class and of its bases
    defined in the same module."""
    names = _assigned_names(cls) | {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        names |= {
            t.attr
            for t in targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
        }
    for base in cls.bases:
        parent = _class(tree, base.id) if isinstance(base, ast.Name) else None
        if parent is not None:
            names |= _class_attributes(tree, parent)
    return names


def _top_level_imports(tree: ast.Module) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module.split(".")[0])
    return mods
