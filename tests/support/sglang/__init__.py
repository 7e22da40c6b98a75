"""The SGLang plugin's test helpers: stand-ins shaped like SGLang 0.5.23's objects, the release wheel,
and the check of that wheel's source against what the plugin relies on."""
