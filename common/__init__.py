"""The torch-free bottom layer every depthdiag package may import; it imports none of them."""
