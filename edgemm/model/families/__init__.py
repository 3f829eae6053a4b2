"""The built-in model families, one module each.

Every module here registers its family with edgemm.model.family.register; the registry
imports them all the first time a family is looked up (modules starting with `_` are
skipped). A new family is one new module: an adapter class (see the Family protocol)
decorated with `@register("<model_type>", ...)`.
"""
