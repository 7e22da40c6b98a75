"""The engines, one module each: a kind of model server and the way hsx takes hidden states from it
(hsx.backends.engine.Engine). hsx.sources.Source names each; nothing imports them but by that name."""
