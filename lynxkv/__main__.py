from lynxkv.cli import entry

entry()
