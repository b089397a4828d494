"""Filesystem work every layer above shares, the bottom layer (no ML framework; a test enforces it):

  atomic     atomic writes: a file or directory is whole or not there
  paths      checks on output paths before a long job; which directories --force may replace; free space
  locks      one writer per output (a lock file beside it)
  reaping    temporary copies that killed writers left behind
  files      sha256 and size of files, the {sha256, bytes} record every manifest keeps, JSON reading
  text       UTF-8 text input, line by line
  parallel   parallel corpora on disk: TSV or two aligned text files
  pinned     a directory held open while it is read: its files come from one copy, whatever replaces it
"""
