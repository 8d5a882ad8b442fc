"""The privacy layer: accountants (RDP, PRV, PLD), sensitivities, the audit's arithmetic, the
ledger."""
