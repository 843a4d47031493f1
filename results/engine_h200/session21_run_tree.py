"""Run a module of another source tree from the repository root: python3 PATH/TO/run_tree.py TREE MODULE ARGS..."""
import runpy, sys
tree, module = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
sys.argv = [module] + sys.argv[3:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
