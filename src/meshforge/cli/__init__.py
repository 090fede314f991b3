"""The `meshforge` command and its sub-commands, one module each; heavy imports happen inside
commands so `meshforge config ...` answers without importing torch."""
