output "inventory" {
  description = "The generated Ansible inventory (INI)."
  value       = module.sarv.inventory
}
