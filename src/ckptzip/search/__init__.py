"""Config search: pick each checkpoint's quantizer config against the user's quality threshold.

Modules: ``spaces`` (each method's search space: DynaQuant's and the baselines' QD / CNR / GOBO,
paper Tables 9-12), ``cube`` (a space in quality order, the divide-and-conquer frontier search),
``quality`` (scores a candidate's reconstruction on a scratch model copy), ``strategies``
(exhaustive / neighbourhood / fallback, ratio estimate, trial runner), and ``ckptzip.dist``
(parallel trials). A strategy is called once per save, in this order::

    1. knobs, info, st = search_config(method, state, reference, ctx, None)  # first save: exhaustive
    2. ... encode with the method config's knobs replaced; info goes into the entry summary ...
    3. knobs, info, st = search_config(method, state2, ref2, ctx2, st)      # neighbourhood of st["best"]

Worked example (what ``DynaQuantMethod`` -- and ``qd`` / ``cnr`` / ``gobo`` -- do when ``eval_fn`` is given)::

    from ckptzip.methods.base import EncodeContext, get_method
    from ckptzip.search import search_config
    from ckptzip.state import flatten_state

    method = get_method("dynaquant")
    flat = flatten_state({"model": model.state_dict()}, model)
    ctx = EncodeContext(step=100, model=model, eval_fn=val_loss, threshold=0.01)
    knobs, info, st = search_config(method, flat, None, ctx, None)
    knobs                                                  # {'prune_metric': 'magnitude', 'bins': 8, ...}
    info["search"], info["evals"], info["degradation"]     # 'exhaustive', 31, 0.0093
"""
from .config import SearchConfig
from .cube import Candidate, ConfigCube
from .quality import QualityJudge
from .spaces import CNRSpace, DynaQuantSpace, GoboSpace, QDSpace, Space
from .strategies import Trial, TrialRunner, estimate_bits, exhaustive_search, neighbourhood_search, search_config

__all__ = ["CNRSpace", "Candidate", "ConfigCube", "DynaQuantSpace", "GoboSpace", "QDSpace", "QualityJudge",
           "SearchConfig", "Space", "Trial", "TrialRunner", "estimate_bits", "exhaustive_search", "neighbourhood_search", "search_config"]
