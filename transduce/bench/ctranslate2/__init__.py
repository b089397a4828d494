"""CTranslate2, the bench's reference: a model directory converted with its own converter (convert), its
settings on this CPU (settings), and the check that it decodes our weights token for token as we do (check)."""
