"""How messages name a parameter: its module name, its name in ``param_names``, else its position."""


class Names:
    """Names of one optimizer's parameters, for messages.

    Args:
        by_param (dict): parameter -> its name in the module the optimizer was built from.
        param_groups (list[dict]): the optimizer's param groups (read when a name is needed).
    """

    def __init__(self, by_param, param_groups):
        self.by_param = by_param
        self.param_groups = param_groups

    def __call__(self, p):
        if p in self.by_param:
            return f"'{self.by_param[p]}'"
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    if names is not None and i < len(names):
                        return f"'{names[i]}'"
                    return f"params[{i}] of param group {gi} (shape {tuple(p.shape)})"
        return f"a parameter of shape {tuple(p.shape)}"

    def of(self, params, most=8):
        """The names of ``params`` for a message, the first ``most`` of them."""
        return ", ".join(self(p) for p in params[:most]) + (", ..." if len(params) > most else "")
