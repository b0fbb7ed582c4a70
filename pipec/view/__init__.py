"""Floor 6: what people look at: report tables, Gantt pictures, the step grid."""
